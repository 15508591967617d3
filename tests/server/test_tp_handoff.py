"""P/D between workers of different tensor-parallel sizes: each decode rank receives exactly
the KV heads it owns from the prefill ranks that hold them, layer by layer, and the tokens
are those of a colocated worker of one process."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.tiny_llama import write_tiny_llama
from tests.server.workers import generate, handoff, start_workers

PROMPTS = [[5, 17, 33, 200, 7, 9, 11], list(range(3, 90))]
GREEDY = {"max_tokens": 8, "ignore_eos": True}
SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory):
    model = str(write_tiny_llama(tmp_path_factory.mktemp("tiny-pd")))
    common = ["--model", model, "--num-kv-blocks", "64"]
    specs = [("ref", "both", common, None)]
    specs += [(f"p{a}", "prefill", [*common, "--tensor-parallel-size", str(a)], None) for a in SIZES]
    specs += [(f"d{b}-{kind}", "decode", [*common, "--tensor-parallel-size", str(b), "--kv-transport", kind], None)
              for b in SIZES for kind in ("tcp", "shm")]
    workers = start_workers(specs)
    yield {spec[0]: w for spec, w in zip(specs, workers)}
    for w in workers:
        w.stop()


@pytest.fixture(scope="module")
def reference(tp_cluster):
    async def all_prompts():
        return await asyncio.gather(*(generate(tp_cluster["ref"], ids, GREEDY) for ids in PROMPTS))

    return [r["token_ids"] for r in asyncio.run(all_prompts())]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "shm"])
@pytest.mark.parametrize("a", SIZES)
@pytest.mark.parametrize("b", SIZES)
def test_prefill_tp_a_to_decode_tp_b_gives_the_colocated_tokens(tp_cluster, reference, a, b, kind):
    prefill, decode = tp_cluster[f"p{a}"], tp_cluster[f"d{b}-{kind}"]

    async def all_prompts():
        return await asyncio.gather(*(handoff(prefill, decode, ids, GREEDY) for ids in PROMPTS))

    for result, expected in zip(asyncio.run(all_prompts()), reference):
        assert not result["errors"], result["errors"]
        assert result["prefill"].status_code == 200, result["prefill"].text
        assert result["token_ids"] == expected
        ticket = result["ticket"]
        assert len(ticket["rank_endpoints"]) == (b if b > 1 else 0)
        transfer = result["prefill"].json()["transfer"]
        assert transfer["layers"] == 2  # rank 0's own streams went out layer by layer
        # every route together moved the prompt's KV once: 2 layers x K,V x 4 heads x 16 fp32
        assert transfer["bytes"] == 2 * 2 * ticket["num_tokens"] * 4 * 16 * 4
    assert decode.wait_free_blocks(64) == 64  # nothing left reserved
