"""Faults a public endpoint meets, against a real `baton up` stack and the official client:
clients that leave or read slowly, a full decode pool, and each server process killed
(SIGKILL) at its worst moment, then restarted by `baton up`'s supervisor.

The kills come last: each waits for the stack to serve again before the next one.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import openai
import pytest

from tests.faults.fault_stack import (
    LAYER_DELAY_S,
    QUEUE_TIMEOUT_S,
    RESERVE_WAIT_S,
    gather_within,
    prompt_for,
)
from tests.faults.slow_reader import SlowReader
from tests.server.workers import new_id

pytestmark = pytest.mark.slow
BACK_WITHIN_S = 60.0  # a killed server is back serving within a minute
EXIT_FAILS_WITHIN_S = 10.0  # in-flight clients of a dead router learn it this fast


def first_text(chunk) -> bool:
    return bool(chunk.choices and chunk.choices[0].text)


def admission_running(stack) -> int:
    return httpx.get(f"{stack.url}/router/state", timeout=10).json()["admission"]["running"]


# -- clients that leave --------------------------------------------------------------------
@pytest.mark.parametrize("path", ["local", "remote"])
def test_a_client_leaving_mid_stream_frees_its_blocks_within_a_second(stack, path):
    idle = stack.free_blocks()

    async def leave() -> list[int]:
        stream = await stack.api().completions.create(
            model=stack.model, prompt=prompt_for(path, new_id()), max_tokens=2000, stream=True,
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first_text(chunk):
                break
        held = await asyncio.to_thread(stack.free_blocks)
        await stream.close()
        return held

    held = asyncio.run(asyncio.wait_for(leave(), 120))
    assert held[1] < idle[1]  # the decode worker held the stream's blocks
    assert stack.wait_idle(idle, 1.0) <= 1.0
    assert admission_running(stack) == 0


@pytest.mark.parametrize("path", ["local", "remote"])
def test_a_non_streaming_client_leaving_frees_its_blocks_within_a_second(stack, path):
    """The remote client leaves while its prompt is still on the prefill worker (a remote
    prefill takes 3 s here), the local one while the decode worker generates."""
    idle = stack.free_blocks()

    async def leave() -> None:
        with pytest.raises(openai.APITimeoutError):
            await stack.api(timeout_s=2.0).completions.create(
                model=stack.model, prompt=prompt_for(path, new_id()), max_tokens=2000,
                extra_body={"ignore_eos": True})

    asyncio.run(asyncio.wait_for(leave(), 60))
    # the decode worker's blocks at once; the prefill worker's copy when the step computing
    # it ends (an engine step is not cut short: here the injected layer delay makes it long)
    started = time.monotonic()
    while stack.decode.state()["free_blocks"] != idle[1]:
        assert time.monotonic() - started < 1.0, stack.free_blocks()
        time.sleep(0.05)
    stack.wait_idle(idle, 1.0 + 30 * LAYER_DELAY_S)
    assert admission_running(stack) == 0


# -- a slow reader -------------------------------------------------------------------------
def test_a_slow_reader_does_not_delay_other_streams(stack):
    idle = stack.free_blocks()

    async def gaps(streams: int = 3, tokens: int = 60) -> list[float]:
        async def one(i: int) -> list[float]:
            seen = []
            stream = await stack.api().completions.create(
                model=stack.model, prompt=f"[{new_id()}] Count to {i}:", max_tokens=tokens, stream=True,
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first_text(chunk):
                    seen.append(time.monotonic())
            return [b - a for a, b in zip(seen[1:], seen[2:])]  # from the second token on

        return [g for found in await gather_within(180, *(one(i) for i in range(streams))) for g in found]

    alone = asyncio.run(gaps())
    reader = SlowReader(stack.url, {"model": stack.model, "prompt": "Write a long story:", "max_tokens": 3000,
                                    "stream": True, "ignore_eos": True})
    try:
        beside = asyncio.run(gaps())
        queued = reader.drain()
    finally:
        reader.close()
    # it really fell behind: more than its own receive buffer holds waited on the router's side
    assert len(queued) > 1.5 * reader.buffer, (len(queued), reader.buffer)
    # the others' pace: one more sequence shares their batch, so a generous factor
    print(f"\nslow reader {len(queued)} bytes behind; others' median gap {statistics.median(alone) * 1e3:.0f} ms "
          f"alone, {statistics.median(beside) * 1e3:.0f} ms beside it")
    assert statistics.median(beside) < 3 * statistics.median(alone), (statistics.median(alone),
                                                                      statistics.median(beside))
    stack.wait_idle(idle, 5.0)  # the reader's close aborted its stream


# -- a full decode pool --------------------------------------------------------------------
def test_a_full_decode_pool_answers_429_with_retry_after_never_a_hang(stack):
    """Every block of the decode worker is reserved (as a router's decode-first reservations
    hold them). A request waits for room at most the worker's queue deadline (after the
    router's reservation retries, for a long prompt), then gets 429 with Retry-After,
    streaming or not. Room back: it serves again."""
    idle = stack.free_blocks()
    hogs = []
    while (free := stack.decode.state()["free_blocks"]) > 0:  # one reservation holds at most a context
        hogs.append(new_id("hog"))
        reply = stack.decode.post("/internal/reserve", {
            "request_id": hogs[-1], "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 1}, "ttl_s": 300,
            "headroom_tokens": min(free * 16, 8000) - 4})
        assert reply.status_code == 200 and len(hogs) < 10, reply.text

    async def refused(path: str, stream: bool):
        with pytest.raises(openai.RateLimitError) as caught:
            await stack.api().completions.create(model=stack.model, prompt=prompt_for(path, new_id()),
                                                 max_tokens=4, stream=stream)
        return caught.value

    try:
        started = time.monotonic()
        errors = asyncio.run(gather_within(120, refused("local", False), refused("remote", False),
                                           refused("local", True)))
        waited = time.monotonic() - started
    finally:
        for hog in hogs:
            stack.decode.post(f"/internal/abort/{hog}")
    for error in errors:
        assert isinstance(error, openai.RateLimitError), repr(error)
        assert int(error.response.headers["retry-after"]) >= 1
        assert error.code == "overloaded" and "no room" in error.message
    print(f"\nfull pool: 3 requests refused with 429 within {waited:.1f}s")
    assert waited < RESERVE_WAIT_S + QUEUE_TIMEOUT_S + 20  # the reservation retries, then the queue deadline
    assert stack.serves()
    stack.wait_idle(idle, 5.0)


# -- killed processes ----------------------------------------------------------------------
def test_prefill_worker_killed_mid_transfer(stack):
    """Killed while its layers stream to the decode worker: the router gives the reservation
    back, falls back to prefilling on the decode worker, and the client gets its answer."""
    idle = stack.free_blocks()
    failed_before = stack.router_count("retries", 'reason="prefill_failed"')
    local_before = stack.router_count("retries", 'reason="fallback_local"')
    restarts = stack.up.printed().count("worker-0 (prefill) restarted")
    victim = stack.process("prefill")

    async def scenario():
        request = asyncio.create_task(stack.api().completions.create(
            model=stack.model, prompt=prompt_for("remote", new_id()), max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True}))
        while (await asyncio.to_thread(stack.decode.state))["reservations"] == 0:
            assert not request.done(), request
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # a third of the way through its layers
        victim.kill()
        return time.monotonic(), await asyncio.wait_for(request, 120)

    killed_at, answer = asyncio.run(scenario())
    assert answer.usage.completion_tokens == 8 and answer.choices[0].finish_reason == "length"
    assert stack.router_count("retries", 'reason="prefill_failed"') == failed_before + 1  # mid-prefill
    assert stack.router_count("retries", 'reason="fallback_local"') == local_before + 1
    stack.up.wait_printed("worker-0 (prefill) restarted", BACK_WITHIN_S, restarts + 1)
    print(f"\nprefill killed: answered {answer.usage.completion_tokens} tokens by local prefill")
    remote_before = stack.router_count("routes", 'path="remote"')
    while stack.router_count("routes", 'path="remote"') == remote_before:  # the prefill path is back
        assert time.monotonic() - killed_at < BACK_WITHIN_S, stack.up.output()
        httpx.post(f"{stack.url}/v1/completions", timeout=60, json={
            "model": stack.model, "prompt": prompt_for("remote", new_id()), "max_tokens": 2})
        time.sleep(0.5)
    stack.wait_idle([stack.prefill.state()["num_blocks"], idle[1]], 5.0)  # the prefill pool is fresh


def test_decode_worker_killed_mid_stream(stack):
    """Streams on both paths lose their decode worker: each either finishes (re-issued with
    the tokens already streamed once the worker is back) or ends with a clear error; none
    hangs, and the stack serves again within a minute."""
    restarts = stack.up.printed().count("worker-1 (decode) restarted")
    victim = stack.process("decode")
    max_tokens = 200  # the remote stream must still be decoding once the local one streams

    async def one(path: str, streaming: list[bool]):
        stream = await stack.api().completions.create(
            model=stack.model, prompt=prompt_for(path, new_id()), max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage, finish, tokens = None, None, 0
        async for chunk in stream:
            tokens += first_text(chunk)
            if tokens >= 3:
                streaming[0] = True
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return finish, usage.completion_tokens

    async def streaming(tasks: list[asyncio.Task], flags: list[list[bool]]) -> None:
        deadline = time.monotonic() + 120
        while not all(f[0] for f in flags):
            assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
            assert time.monotonic() < deadline, "the streams never started"
            await asyncio.sleep(0.05)

    async def scenario():
        # the remote stream first: its prefill takes seconds, in which a local stream started
        # alongside could already have finished on a fast CPU
        flags = [[False], [False]]
        tasks = [asyncio.create_task(one("remote", flags[0]))]
        await streaming(tasks, flags[:1])
        tasks.append(asyncio.create_task(one("local", flags[1])))
        await streaming(tasks, flags)
        victim.kill()
        killed_at = time.monotonic()
        # a fresh request gets through again while the two streams finish (a probe, alongside)
        back = asyncio.create_task(asyncio.to_thread(stack.wait_serving, killed_at, BACK_WITHIN_S))
        outcomes = await gather_within(180, *tasks)
        return outcomes, await back

    outcomes, back = asyncio.run(scenario())
    print(f"\ndecode killed: outcomes {[o if not isinstance(o, BaseException) else repr(o)[:80] for o in outcomes]}")
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, openai.APIError) and str(outcome), repr(outcome)
        else:
            assert outcome == ("length", max_tokens), outcome
    print(f"decode killed: serving again {back:.1f}s after the kill")
    stack.up.wait_printed("worker-1 (decode) restarted", 5, restarts + 1)
    num_blocks = [w.state()["num_blocks"] for w in stack.workers]
    stack.wait_idle(num_blocks, 10.0)


def test_router_killed_and_restarted_under_load(stack):
    """Sixteen streams in flight when the router dies: each client gets a connection error
    at once, the workers stop their sequences (every free block back), and the restarted
    router serves at the same address within a minute."""
    idle = stack.free_blocks()
    restarts = stack.up.printed().count("router restarted")
    paths = ["remote" if i % 8 == 0 else "local" for i in range(16)]  # remote prefills queue: 3 s each

    async def one(path: str, streaming: set, i: int):
        stream = await stack.api().completions.create(
            model=stack.model, prompt=prompt_for(path, new_id()), max_tokens=2000, stream=True,
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first_text(chunk):
                streaming.add(i)
        return "finished"

    async def scenario():
        streaming: set[int] = set()
        tasks = [asyncio.create_task(one(p, streaming, i)) for i, p in enumerate(paths)]
        deadline = time.monotonic() + 120
        while len(streaming) < len(tasks):
            assert time.monotonic() < deadline and not any(t.done() for t in tasks)
            await asyncio.sleep(0.05)
        held = await asyncio.to_thread(stack.free_blocks)
        stack.process("router").kill()
        killed_at = time.monotonic()
        outcomes = await gather_within(EXIT_FAILS_WITHIN_S, *tasks)
        return held, killed_at, outcomes, time.monotonic() - killed_at

    held, killed_at, outcomes, failed_after = asyncio.run(scenario())
    assert held[1] < idle[1]
    assert all(isinstance(o, openai.APIConnectionError) for o in outcomes), outcomes
    assert failed_after < EXIT_FAILS_WITHIN_S
    stack.wait_idle(idle, 10.0)  # nothing the dead router started keeps blocks on a worker
    back = stack.wait_serving(killed_at, BACK_WITHIN_S)
    print(f"\nrouter killed: {len(outcomes)} clients failed within {failed_after:.2f}s; serving again after {back:.1f}s")
    stack.up.wait_printed("router restarted", 5, restarts + 1)
    stack.up.wait_printed("router is ready again", 10, restarts + 1)
