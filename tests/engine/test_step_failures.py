"""A failure inside a step ends only the sequence that causes it; the batch goes on."""

from __future__ import annotations

import asyncio

import pytest

from baton.engine import SamplingParams
from baton.engine.async_engine import AsyncEngine, EngineError

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _broken_listener(layer, *_):
    if layer == 3:
        raise RuntimeError("listener broke at layer 3")


def test_a_failing_sequence_ends_alone_and_the_others_finish(engine_fp32):
    e = engine_fp32
    free = e.blocks.num_free_blocks
    expected = e.generate(["The quick brown fox", "def fibonacci(n):"], PARAMS)
    good_a = e.add_request("The quick brown fox", PARAMS)
    bad = e.add_request("Once upon a time", PARAMS)
    e.sequences[bad].layer_listener = _broken_listener  # a KV streamer that fails mid-step
    good_b = e.add_request("def fibonacci(n):", PARAMS)
    final = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                final[out.request_id] = out
    assert final[bad].finish_reason == "abort"
    assert "listener broke at layer 3" in final[bad].error
    assert final[good_a].error is None and final[good_a].token_ids == expected[0].token_ids
    assert final[good_b].token_ids == expected[1].token_ids
    for rid in (good_a, bad, good_b):
        e.release(rid)
    assert e.blocks.num_free_blocks == free and not e.sequences


def test_the_async_engine_reports_the_error_to_that_stream_only(engine_fp32):
    async def main():
        ae = AsyncEngine(engine_fp32).start()
        try:
            q_bad, q_good = ae.open_stream("bad"), ae.open_stream("good")

            def add_both(e):  # in one call: they share their steps
                e.add_request("The quick brown fox", PARAMS, "good")
                e.add_request("Once upon a time", PARAMS, "bad")
                e.sequences["bad"].layer_listener = _broken_listener

            await ae.call(add_both)
            with pytest.raises(EngineError, match="listener broke"):
                async for _ in ae.iterate(q_bad, 30):
                    pass
            outs = [out async for out in ae.iterate(q_good, 30)]
            assert outs[-1].finished and len(outs[-1].token_ids) == 6
            assert await ae.call(lambda e: len(e.sequences)) == 0
        finally:
            ae.close_stream("bad")
            ae.close_stream("good")
            ae.shutdown()

    asyncio.run(main())


def test_a_seeded_neighbour_keeps_its_random_stream_through_the_retry(engine_fp32):
    e = engine_fp32
    seeded = dict(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    expected = e.generate(["The quick brown fox"], SamplingParams(**seeded))[0].token_ids
    good = e.add_request("The quick brown fox", SamplingParams(**seeded))
    bad_params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    bad = e.add_request("Once upon a time", bad_params)
    bad_params.temperature = float("nan")  # past validation: the sampler fails on its row
    final = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                final[out.request_id] = out
    assert final[bad].finish_reason == "abort" and final[bad].error
    assert final[good].token_ids == expected  # the failed batch cost it no draw
    e.release(good)
    e.release(bad)
