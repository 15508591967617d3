"""Faults with real processes: a prefill worker dies mid-transfer; a decode worker is gone."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import DOOMED_LAYER_DELAY_S, GREEDY
from tests.server.workers import TOKEN, free_port, new_id, read_stream

pytestmark = pytest.mark.slow


def test_killed_prefill_fails_clearly_and_its_reservation_is_retried_or_freed(cluster, prompt_ids, reference):
    """Two prompts stream from a slow prefill worker that is killed part-way. The caller
    gets an error at once; one reservation is retried on a healthy prefill worker with the
    same ticket (identical tokens), the other expires and gives its blocks back."""
    decode, doomed, healthy = cluster["decode-tcp"], cluster["doomed-prefill"], cluster["prefill"]
    free = decode.state()["free_blocks"]
    ttl = 6.0
    rids, tickets = [new_id("retried"), new_id("abandoned")], []
    for rid in rids:
        reply = decode.post("/internal/reserve", {"request_id": rid, "prompt_token_ids": prompt_ids[7],
                                                  "params": GREEDY, "ttl_s": ttl, "headroom_tokens": 16})
        assert reply.status_code == 200
        tickets.append(reply.json()["ticket"])

    def prefill_body(i):
        return {"request_id": rids[i], "prompt_token_ids": prompt_ids[7], "params": GREEDY, "ticket": tickets[i]}

    async def scenario():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
            streams = [asyncio.create_task(read_stream(client, "GET", f"{decode.url}/internal/stream/{rid}"))
                       for rid in rids]
            calls = [asyncio.create_task(client.post(f"{doomed.url}/internal/prefill", json=prefill_body(i)))
                     for i in range(2)]
            await asyncio.sleep(1.0 + 8 * DOOMED_LAYER_DELAY_S)  # a few layers of each are out
            assert not any(c.done() for c in calls)
            assert decode.state()["reservations"] == 2
            doomed.kill()
            started = time.monotonic()
            for call in calls:
                with pytest.raises(httpx.HTTPError):
                    await call  # the caller learns at once: the connection is gone
            caller_error_after = time.monotonic() - started
            retry = await client.post(f"{healthy.url}/internal/prefill", json=prefill_body(0))
            results = await asyncio.wait_for(asyncio.gather(*streams), ttl + 5)
            return caller_error_after, retry, results

    caller_error_after, retry, (retried, abandoned) = asyncio.run(scenario())
    assert caller_error_after < 2.0
    assert retry.status_code == 200, retry.text
    assert retried["token_ids"] == reference[7] and not retried["errors"]
    # the abandoned stream's reader gets a clear error once the ticket expires, not a hang
    assert abandoned["token_ids"] == [] and "expired" in abandoned["errors"][0]["message"]
    assert decode.wait_free_blocks(free, timeout=5) == free
    assert decode.state()["reservations"] == 0


def test_unreachable_decode_worker_is_a_clear_error_before_the_deadline(cluster, prompt_ids):
    prefill = cluster["prefill"]
    free = prefill.state()["free_blocks"]
    ticket = cluster["decode-tcp"].post("/internal/reserve", {
        "request_id": (rid := new_id("nowhere")), "prompt_token_ids": prompt_ids[0], "params": GREEDY}).json()["ticket"]
    cluster["decode-tcp"].post(f"/internal/abort/{rid}")
    ticket["kv_endpoint"] = f"tcp://127.0.0.1:{free_port()}"  # nobody listens there
    started = time.monotonic()
    reply = prefill.post("/internal/prefill", {"request_id": rid, "prompt_token_ids": prompt_ids[0],
                                               "params": GREEDY, "ticket": ticket, "timeout_s": 20})
    assert time.monotonic() - started < 20
    assert reply.status_code == 502 and "cannot connect" in reply.json()["error"]["message"]
    assert prefill.wait_free_blocks(free) == free  # its copy of the prompt is released
