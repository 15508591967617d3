"""The worker's wait for a queued request to start (server/admissions.py) on the real
engine loop: no wake while the request waits for room, a wake once it runs or is gone, and
an engine that waits instead of spinning while nothing it holds can run."""

from __future__ import annotations

import asyncio
import time

from baton.engine import SamplingParams, handoff
from baton.engine.async_engine import AsyncEngine
from baton.server.admissions import Admissions

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def test_a_waiter_wakes_when_its_request_runs_or_is_gone_not_while_it_waits(engine_fp32):
    e = engine_fp32
    free = e.blocks.num_free_blocks

    def fill(engine) -> list[str]:
        hogs = []
        while engine.blocks.num_free_blocks:
            hogs.append(f"hog-{len(hogs)}")
            room = min(engine.blocks.num_free_blocks * engine.config.block_size, engine.max_model_len) - 8
            handoff.reserve_remote(engine, [1, 2, 3], PARAMS, hogs[-1], room)
        return hogs

    async def main():
        ae = AsyncEngine(e).start()
        admissions = Admissions()
        ae.step_observers.append(lambda *_: admissions.after_step(e))
        steps = []
        ae.step_observers.append(lambda *_: steps.append(1))
        try:
            hogs = await ae.call(fill)
            waiters = {rid: admissions.waiter() for rid in ("queued", "dropped")}

            def add(engine, rid):
                engine.add_request("The quick brown fox", PARAMS, rid)
                admissions.watch(rid, waiters[rid])

            for rid in waiters:
                await ae.call(add, rid)
            before = len(steps)
            await asyncio.sleep(1.0)
            assert not any(event.is_set() for _, event in waiters.values())  # no room: still queued
            assert len(steps) - before < 100  # it waits for a call, it does not spin (tens of thousands)
            await ae.call(lambda engine: engine.abort("dropped") and engine.release("dropped"))
            await asyncio.wait_for(waiters["dropped"][1].wait(), 5)  # gone: its waiter learns at once
            assert not waiters["queued"][1].is_set()
            for hog in hogs:
                await ae.call(handoff.cancel_remote, hog)
            await asyncio.wait_for(waiters["queued"][1].wait(), 10)  # room back: it runs
            deadline = time.monotonic() + 30
            while "queued" in e.sequences and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            ae.shutdown()

    asyncio.run(main())
    assert e.blocks.num_free_blocks == free and not e.sequences
