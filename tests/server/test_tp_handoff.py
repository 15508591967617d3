"""P/D between workers of different tensor-parallel sizes: each decode rank receives exactly
the KV heads it owns from the prefill ranks that hold them, layer by layer, and the tokens
are those of a colocated worker of one process.

The tiny model's matrix over TCP runs with `make test`; its shared-memory half and the
SmolLM2 matrix start tens of rank processes and are marked heavy (`make test-tp`)."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.tiny_llama import write_tiny_llama
from tests.server.workers import generate, handoff, start_workers

PROMPTS = [[5, 17, 33, 200, 7, 9, 11], list(range(3, 90))]
GREEDY = {"max_tokens": 8, "ignore_eos": True}
SIZES = (1, 2, 4)
POOL = 64


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-pd")))


def _common(model):
    return ["--model", model, "--num-kv-blocks", str(POOL)]


@pytest.fixture(scope="module")
def tiny_prefill(tiny_model):
    """A colocated worker of one process (the reference) and prefill workers of TP 1, 2, 4."""
    specs = [("ref", "both", _common(tiny_model), None)]
    specs += [(f"p{a}", "prefill", [*_common(tiny_model), "--tensor-parallel-size", str(a)], None) for a in SIZES]
    workers = start_workers(specs)
    yield {spec[0]: w for spec, w in zip(specs, workers)}
    for w in workers:
        w.stop()


def _decoders(model, kind):
    specs = [(f"d{b}-{kind}", "decode",
              [*_common(model), "--tensor-parallel-size", str(b), "--kv-transport", kind], None) for b in SIZES]
    return specs, start_workers(specs)


@pytest.fixture(scope="module")
def tiny_decode_tcp(tiny_model):
    specs, workers = _decoders(tiny_model, "tcp")
    yield {spec[0]: w for spec, w in zip(specs, workers)}
    for w in workers:
        w.stop()


@pytest.fixture(scope="module")
def tiny_decode_shm(tiny_model):
    specs, workers = _decoders(tiny_model, "shm")
    yield {spec[0]: w for spec, w in zip(specs, workers)}
    for w in workers:
        w.stop()


@pytest.fixture(scope="module")
def tiny_reference(tiny_prefill):
    async def all_prompts():
        return await asyncio.gather(*(generate(tiny_prefill["ref"], ids, GREEDY) for ids in PROMPTS))

    return [r["token_ids"] for r in asyncio.run(all_prompts())]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", pytest.param("shm", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("a", SIZES)
@pytest.mark.parametrize("b", SIZES)
def test_prefill_tp_a_to_decode_tp_b_gives_the_colocated_tokens(request, tiny_prefill, tiny_reference, a, b, kind):
    prefill = tiny_prefill[f"p{a}"]
    decode = request.getfixturevalue(f"tiny_decode_{kind}")[f"d{b}-{kind}"]

    async def all_prompts():
        return await asyncio.gather(*(handoff(prefill, decode, ids, GREEDY) for ids in PROMPTS))

    for result, expected in zip(asyncio.run(all_prompts()), tiny_reference):
        assert not result["errors"], result["errors"]
        assert result["prefill"].status_code == 200, result["prefill"].text
        assert len(expected) == GREEDY["max_tokens"] and result["token_ids"] == expected
        ticket = result["ticket"]
        assert len(ticket["rank_endpoints"]) == (b if b > 1 else 0)
        transfer = result["prefill"].json()["transfer"]
        assert transfer["layers"] == 2  # rank 0's own routes went out layer by layer
        # every route together moved the prompt's KV once: 2 layers x K,V x 4 heads x 16 fp32
        assert transfer["bytes"] == 2 * 2 * ticket["num_tokens"] * 4 * 16 * 4
    assert decode.wait_free_blocks(POOL) == POOL  # nothing left reserved on the decode side


@pytest.fixture(scope="module")
def smollm2_tp3():
    """SmolLM2 (9 query / 3 KV heads) split over 3 ranks: a prefill worker and decode workers
    over TCP and shared memory; the TP=1 ends are the shared cluster's."""
    pool = ["--block-size", "16", "--tensor-parallel-size", "3", "--kv-cache-memory-gb", "0.05"]
    specs = [("p3", "prefill", pool, None)]
    specs += [(f"d3-{kind}", "decode", [*pool, "--kv-transport", kind], None) for kind in ("tcp", "shm")]
    workers = start_workers(specs)
    yield {spec[0]: w for spec, w in zip(specs, workers)}
    for w in workers:
        w.stop()


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["tcp", "shm"])
@pytest.mark.parametrize("a,b", [(1, 3), (3, 1), (3, 3)])
def test_smollm2_between_tp1_and_tp3_gives_the_colocated_tokens(cluster, smollm2_tp3, prompt_ids, reference,
                                                                 a, b, kind):
    """(1, 1) is test_handoff's; the cluster's decode-tcp worker uses 32-token blocks, so
    the (3, 1) routes also cross a block-size change."""
    workers = {**smollm2_tp3, "p1": cluster["prefill"], "d1-tcp": cluster["decode-tcp"],
               "d1-shm": cluster["decode-shm"]}
    prefill, decode = workers[f"p{a}"], workers[f"d{b}-{kind}"]
    params = {"max_tokens": len(reference[0]), "ignore_eos": True}
    chosen = [0, 5, 7]  # short, long, and longer than one 32-token decode block

    async def all_prompts():
        return await asyncio.gather(*(handoff(prefill, decode, prompt_ids[i], params) for i in chosen))

    for result, i in zip(asyncio.run(all_prompts()), chosen):
        assert not result["errors"], result["errors"]
        assert result["token_ids"] == reference[i]
