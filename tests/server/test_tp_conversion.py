"""A role switch that changes the tensor-parallel size: a drained worker moves onto a new
group of ranks (started and loaded before the old one stops), keeps the KV memory per rank,
and hands off KV in its new layout with the tokens of a worker of one process."""

from __future__ import annotations

import asyncio
import time

import pytest

from baton.autoscaler.ray_actuator import RayActuator, role_body
from tests.engine.tiny_llama import write_tiny_llama
from tests.server.workers import TOKEN, generate, handoff, start_workers

PROMPTS = [[5, 17, 33, 200, 7, 9, 11], list(range(3, 90))]
GREEDY = {"max_tokens": 8, "ignore_eos": True}
POOL = 64


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    model = str(write_tiny_llama(tmp_path_factory.mktemp("tiny-regroup")))
    args = ["--model", model, "--num-kv-blocks", str(POOL)]
    specs = [("ref", "both", args, None), ("d1", "decode", args, None),
             ("p2", "prefill", [*args, "--tensor-parallel-size", "2"], None)]
    started = start_workers(specs)
    yield {spec[0]: w for spec, w in zip(specs, started)}
    for w in started:
        w.stop()


@pytest.fixture(scope="module")
def reference(workers):
    async def all_prompts():
        return await asyncio.gather(*(generate(workers["ref"], ids, GREEDY) for ids in PROMPTS))

    return [r["token_ids"] for r in asyncio.run(all_prompts())]


def _handoffs(prefill, decode):
    async def all_prompts():
        return await asyncio.gather(*(handoff(prefill, decode, ids, GREEDY) for ids in PROMPTS))

    return asyncio.run(all_prompts())


def _assert_reference(results, reference):
    for result, expected in zip(results, reference):
        assert not result["errors"], result["errors"]
        assert result["prefill"].status_code == 200, result["prefill"].text
        assert len(expected) == GREEDY["max_tokens"] and result["token_ids"] == expected


def _switch(worker, role: str, size: int) -> dict:
    drain = worker.post("/internal/drain", {"peers": []})
    assert drain.status_code == 202, drain.text
    deadline = time.monotonic() + 30
    while worker.get("/internal/drain").json()["state"] != "drained":
        assert time.monotonic() < deadline, "the worker did not drain"
        time.sleep(0.05)
    reply = worker.post("/internal/role", {"role": role, "tensor_parallel_size": size}, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.slow
def test_a_tp2_prefill_worker_becomes_a_tp1_decode_worker_and_back(workers, reference):
    ref, d1, p2 = workers["ref"], workers["d1"], workers["p2"]
    _assert_reference(_handoffs(p2, d1), reference)
    prefill_blocks = p2.state()["num_blocks"]

    async def stream_while(switch):
        # a decode stream fed by p2 keeps running on d1 while p2 changes its group
        long = {"max_tokens": 48, "ignore_eos": True}
        decoding = asyncio.Event()

        async def on_event(event, result):
            decoding.set()

        flowing = asyncio.create_task(handoff(p2, d1, PROMPTS[1], long, on_event=on_event))
        # the first token means the prefill is done and d1 decodes the rest
        await asyncio.wait([flowing, asyncio.create_task(decoding.wait())], timeout=60,
                           return_when=asyncio.FIRST_COMPLETED)
        assert decoding.is_set(), f"no token streamed: {flowing.result() if flowing.done() else 'timed out'}"
        switched = await asyncio.to_thread(switch)
        return switched, await asyncio.wait_for(flowing, 120)

    switched, streamed = asyncio.run(stream_while(lambda: _switch(p2, "decode", 1)))
    assert not streamed["errors"] and len(streamed["token_ids"]) == 48
    assert streamed["token_ids"][: GREEDY["max_tokens"]] == reference[1]
    state = p2.state()
    assert switched["tensor_parallel_size"] == 1 and state["tensor_parallel_size"] == 1
    assert switched["weights"] == "reloaded"  # one rank needs the heads the other held
    assert state["role"] == "decode" and state["state"] == "active" and state["rank_pids"] == []
    # one rank now holds all 4 KV heads where each held 2: half the blocks in the same memory,
    # then the decode shape (4x a prefill pool)
    assert state["num_blocks"] == prefill_blocks // 2 * 4
    _assert_reference(_handoffs(ref, p2), reference)  # now the decode end, in one process

    back = _switch(p2, "prefill", 2)
    state = p2.state()
    assert back["tensor_parallel_size"] == 2 and len(state["rank_pids"]) == 1
    assert back["weights"] == "resliced"  # rank 0 keeps half of what it held
    assert state["role"] == "prefill" and state["num_blocks"] == prefill_blocks
    _assert_reference(_handoffs(p2, d1), reference)
    assert d1.wait_free_blocks(POOL) == POOL  # nothing left reserved on the decode side


def test_a_size_the_model_cannot_split_is_refused_and_nothing_changes(workers):
    p2 = workers["p2"]
    before = p2.state()
    drain = p2.post("/internal/drain", {"peers": []})
    assert drain.status_code == 202
    try:
        reply = p2.post("/internal/role", {"role": "decode", "tensor_parallel_size": 3})
        assert reply.status_code == 400
        message = reply.json()["error"]["message"]
        assert "tensor-parallel size 3" in message and "8 query heads" in message
        bad = p2.post("/internal/role", {"role": "decode", "tensor_parallel_size": "two"})
        assert bad.status_code == 400 and "tensor_parallel_size" in bad.json()["error"]["message"]
        after = p2.state()
        for key in ("role", "tensor_parallel_size", "num_blocks", "rank_pids"):
            assert after[key] == before[key], key
    finally:  # back to work in the role it had
        assert p2.post("/internal/role", {"role": before["role"]}).status_code == 200
    assert p2.state()["state"] == "active"


@pytest.mark.slow
def test_baton_ups_actuator_carries_each_pools_size_through_a_conversion(workers, reference):
    """`baton up --autoscale --prefill-tp 2 --decode-tp 1` converts with these sizes."""
    p2, d1 = workers["p2"], workers["d1"]
    actuator = RayActuator(workers=[p2.url], token=TOKEN, poll_s=0.05,
                           tensor_parallel_sizes={"prefill": 2, "decode": 1})

    async def convert(source: str, target: str) -> tuple[bool, dict]:
        done = await actuator.convert(p2.url, source, target, [])
        return done, await asyncio.to_thread(p2.state)

    async def there_and_back():
        try:
            return await convert("prefill", "decode"), await convert("decode", "prefill")
        finally:
            await actuator.aclose()

    (to_decode, as_decode), (to_prefill, as_prefill) = asyncio.run(there_and_back())
    assert to_decode and (as_decode["role"], as_decode["tensor_parallel_size"]) == ("decode", 1)
    assert to_prefill and (as_prefill["role"], as_prefill["tensor_parallel_size"]) == ("prefill", 2)
    assert as_prefill["state"] == "active"
    _assert_reference(_handoffs(p2, d1), reference)


def test_the_role_body_names_a_size_only_where_the_pools_set_one():
    assert role_body("decode", {"prefill": 2, "decode": 1}) == {"role": "decode", "tensor_parallel_size": 1}
    assert role_body("decode", {}) == {"role": "decode"}
