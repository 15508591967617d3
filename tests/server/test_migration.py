"""Migration of a decoding sequence, and drain + role switch, between real workers."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from baton.server.cpu_priority import thread_policies
from tests.server.conftest import NEW_TOKENS
from tests.server.workers import TOKEN, generate, handoff, new_id

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("blocks_restored", "roles_restored")]

LONG = {"max_tokens": 40, "ignore_eos": True}
# long enough to be still decoding when a drain arrives, at the speed of quantized weights
DRAINED = {"max_tokens": 160, "ignore_eos": True}


def long_reference(cluster, ids, params=LONG):
    r = asyncio.run(generate(cluster["both"], ids, params))
    assert not r["errors"] and len(r["token_ids"]) == params["max_tokens"]
    return r["token_ids"]


def decoding_flag(tokens: int = 2):
    """(event set once a stream has `tokens` tokens, its on_event callback)."""
    flag = asyncio.Event()

    async def on_event(_event, so_far):
        if len(so_far["token_ids"]) >= tokens:
            flag.set()

    return flag, on_event


def drained_status(worker, within_s: float = 10.0) -> dict:
    """The drain's status once it is over: the last stream can end a moment before the drain
    task sees that nothing runs any more."""
    deadline = time.monotonic() + within_s
    while (status := worker.get("/internal/drain").json())["state"] == "draining":
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    return status


async def drain(worker, peers: list[str]) -> httpx.Response:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
        return await client.post(worker.url + "/internal/drain", json={"peers": peers})


async def migrate_after(worker, rid: str, target: str, after_tokens: int, result: dict, event_result) -> None:
    if "migrated" not in result and len(event_result["token_ids"]) >= after_tokens:
        result["migrated"] = True
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
            reply = await client.post(worker.url + "/internal/migrate", json={"request_id": rid, "target": target})
        result["reply"] = reply


def test_migration_mid_generation_is_token_identical(cluster, prompt_ids):
    source, target = cluster["decode-tcp"], cluster["decode-shm"]
    ids = prompt_ids[5]
    expected = long_reference(cluster, ids)
    rid = new_id("mig")
    outcome: dict = {}
    migrated_in = target.metric("baton_migrations_total")

    async def on_event(_event, so_far):
        await migrate_after(source, rid, target.url, 5, outcome, so_far)

    result = asyncio.run(generate(source, ids, LONG, rid=rid, on_event=on_event))
    assert outcome["reply"].status_code == 200, outcome["reply"].text
    assert not result["errors"], result["errors"]
    assert result["token_ids"] == expected
    assert result["finish_reason"] == "length"
    assert target.metric("baton_migrations_total") == migrated_in + 1


def test_migration_to_a_full_worker_keeps_the_sequence(cluster, prompt_ids):
    source = cluster["decode-tcp"]
    ids = prompt_ids[1]
    expected = long_reference(cluster, ids)
    rid = new_id("stay")
    outcome: dict = {}

    async def on_event(_event, so_far):
        # a prefill worker takes no imports: the migration fails and the sequence stays
        await migrate_after(source, rid, cluster["prefill"].url, 3, outcome, so_far)

    result = asyncio.run(generate(source, ids, LONG, rid=rid, on_event=on_event))
    assert outcome["reply"].status_code == 409, outcome["reply"].text
    assert result["token_ids"] == expected and not result["errors"]


def test_drain_switch_to_prefill_serve_and_switch_back(cluster, prompt_ids, reference):
    worker, peer = cluster["decode-tcp"], cluster["decode-shm"]
    start = worker.state()
    expected = [long_reference(cluster, prompt_ids[i], DRAINED) for i in (2, 4)]
    rids = [new_id("drain") for _ in expected]

    async def scenario():
        flags, streams = [], []
        for i, rid in zip((2, 4), rids):
            flag, on_event = decoding_flag()
            flags.append(flag)
            streams.append(asyncio.create_task(generate(worker, prompt_ids[i], DRAINED, rid=rid, on_event=on_event)))
        await asyncio.wait_for(asyncio.gather(*(flag.wait() for flag in flags)), 60)  # both are decoding
        reply = await drain(worker, [peer.url])
        assert reply.status_code == 202, reply.text
        assert worker.get("/ready").status_code == 503  # routers stop sending
        results = await asyncio.gather(*streams)
        return results

    results = asyncio.run(scenario())
    for got, want in zip(results, expected):
        assert not got["errors"] and got["token_ids"] == want
    status = drained_status(worker)
    assert status["state"] == "drained" and status["running"] == 0
    assert sorted(status["migrated"]) == sorted(rids)

    assert set(thread_policies(worker.proc.pid).values()) == {os.SCHED_OTHER}  # decoding: normal
    switched = worker.post("/internal/role", {"role": "prefill"})
    assert switched.status_code == 200, switched.text
    assert set(thread_policies(worker.proc.pid).values()) == {os.SCHED_IDLE}  # --prefill-cpu-priority idle
    state = worker.state()
    assert state["role"] == "prefill" and state["state"] == "active"
    assert state["weights_ptr"] == start["weights_ptr"]  # no weight reload
    assert state["num_blocks"] < start["num_blocks"]
    assert state["max_num_batched_tokens"] > start["max_num_batched_tokens"]

    served = asyncio.run(handoff(worker, peer, prompt_ids[6], {"max_tokens": NEW_TOKENS, "ignore_eos": True}))
    assert served["prefill"].status_code == 200, served["prefill"].text
    assert served["token_ids"] == reference[6]

    back = worker.post("/internal/role", {"role": "decode"})
    assert back.status_code == 200, back.text
    state = worker.state()
    assert (state["role"], state["num_blocks"], state["weights_ptr"]) == ("decode", start["num_blocks"], start["weights_ptr"])
    assert worker.get("/ready").status_code == 200
    # every thread back, those started while it was a prefill worker (and inherited idle) too;
    # leaving SCHED_IDLE takes privilege, without which the worker says it could not
    back_to = os.SCHED_OTHER if os.geteuid() == 0 else os.SCHED_IDLE
    assert set(thread_policies(worker.proc.pid).values()) == {back_to}
    assert worker.metric("baton_role_conversions_total") >= 2


def test_drain_without_room_lets_sequences_finish_here(cluster, prompt_ids):
    worker = cluster["decode-shm"]
    ids = prompt_ids[0]
    expected = long_reference(cluster, ids, DRAINED)
    rid = new_id("kept")

    async def scenario():
        flag, on_event = decoding_flag()
        stream = asyncio.create_task(generate(worker, ids, DRAINED, rid=rid, on_event=on_event))
        await asyncio.wait_for(flag.wait(), 60)
        # the only peer is a prefill worker: it takes no imports, so the sequence stays
        assert (await drain(worker, [cluster["prefill"].url])).status_code == 202
        return await stream

    result = asyncio.run(scenario())
    assert result["token_ids"] == expected and not result["errors"]
    status = drained_status(worker)
    assert status["state"] == "drained" and status["kept"] == [rid] and status["migrated"] == []
    refused = worker.post("/internal/reserve", {"request_id": new_id(), "prompt_token_ids": ids, "params": LONG})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_accepting"
    # switching to the role it already has reactivates it
    assert worker.post("/internal/role", {"role": "decode"}).status_code == 200
    assert worker.get("/ready").status_code == 200
