"""The router in front of two real colocated workers: a conversation's next turn goes back to
the worker holding its history, even when that worker is one request busier than the other
(`--decode-routing prefix`, the default; the load-only order is the policy's unit tests')."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from router_harness import running_router

from tests.server.workers import TOKEN, WorkerProcess, new_id, read_stream, start_workers

pytestmark = pytest.mark.asyncio
STORY = ("The lighthouse keeper climbed the stairs each evening, counted the ships that passed "
         "the reef, and wrote their names in a book that nobody else would ever read. ")


@pytest.fixture(scope="module")
def colocated():
    pool = ["--block-size", "16", "--kv-cache-memory-gb", "0.2"]
    workers = start_workers([("c1", "both", pool, None), ("c2", "both", pool, None)])
    yield workers
    for w in workers:
        w.stop()


def lookups(workers: list[WorkerProcess]) -> dict[str, tuple[float, float]]:
    """Each worker's prompt tokens looked up in, and found in, its prefix cache."""
    return {w.url: (w.metric("baton_prefix_cache_queries_total"), w.metric("baton_prefix_cache_hits_total"))
            for w in workers}


def changed(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    return {url: (after[url][0] - before[url][0], after[url][1] - before[url][1])
            for url in after if after[url] != before[url]}


async def hold_busy(worker: WorkerProcess, router: str, ready: asyncio.Event) -> None:
    """A long request straight to `worker` (not through the router), until cancelled; `ready`
    once the router's poll counts it there and sees every other worker healthy and idle (a
    poll that timed out on a loaded machine leaves a worker out of the choice)."""
    body = {"request_id": new_id("busy"), "prompt_token_ids": [1, 2, 3],
            "params": {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}}

    async def watch() -> None:
        async with httpx.AsyncClient() as http:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                state = (await http.get(f"{router}/router/state")).json()
                busy = any(w["url"] == worker.url and w["running"] >= 1 for w in state["workers"])
                others_idle = all(w["healthy"] and w["state"] == "active" and w["running"] + w["waiting"] == 0
                                  for w in state["workers"] if w["url"] != worker.url)
                if busy and others_idle:
                    ready.set()
                    return
                await asyncio.sleep(0.05)
            raise TimeoutError("the router never saw the busy request")

    async with httpx.AsyncClient() as http:
        await asyncio.gather(read_stream(http, "POST", worker.url + "/internal/generate", body), watch())


async def idle(workers: list[WorkerProcess], timeout_s: float = 10.0) -> None:
    """Wait until no worker runs anything (a cancelled client's request ends there soon after)."""
    deadline = time.monotonic() + timeout_s
    while any(w.state()["running"] for w in workers):
        assert time.monotonic() < deadline, "a worker still runs a request nobody waits for"
        await asyncio.sleep(0.1)


async def test_a_conversations_next_turn_finds_its_history(colocated, model_info):
    await idle(colocated)
    async with running_router(model_info, [w.url for w in colocated], internal_token=TOKEN) as router:
        api = openai.AsyncOpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0, timeout=60)
        history = STORY * 3  # ~100 tokens: six full blocks at least
        before = lookups(colocated)
        first = await api.completions.create(model="smollm2", prompt=history, max_tokens=4, temperature=0)
        (home, _), = changed(before, lookups(colocated)).items()
        ready = asyncio.Event()
        busy = asyncio.create_task(hold_busy(next(w for w in colocated if w.url == home), router, ready))
        try:
            await asyncio.wait_for(ready.wait(), 15)
            before = lookups(colocated)
            history += first.choices[0].text + " Then what happened?"
            await api.completions.create(model="smollm2", prompt=history, max_tokens=4, temperature=0)
            turn = changed(before, lookups(colocated))
        finally:
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
    (where, (queried, found)), = turn.items()
    assert where == home  # one request busier than the other worker: within the slack
    assert found >= 6 * 16  # the first turn's full blocks were not computed again
    assert queried > found
