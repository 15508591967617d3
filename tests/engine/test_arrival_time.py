"""A request's arrival is when it reached the worker, not when the step loop took it in: the
loop takes requests between steps, and a prompt that came during a long step waited for its
end (the worker's time-to-first-token histogram counts that wait too)."""

from __future__ import annotations

import asyncio
import time

from baton.engine import SamplingParams
from baton.engine.async_engine import AsyncEngine

ONE = SamplingParams(max_tokens=1)


def test_a_request_keeps_the_arrival_it_is_given_but_never_one_in_the_future(engine_fp32):
    engine = engine_fp32
    engine.add_request("Arrived a while ago.", ONE, request_id="early", arrival_time=time.monotonic() - 5.0)
    engine.add_request("Arrives later than now.", ONE, request_id="late", arrival_time=time.monotonic() + 5.0)
    try:
        now = time.monotonic()
        assert now - 5.5 < engine.sequences["early"].arrival_time < now - 4.5
        assert engine.sequences["late"].arrival_time <= now
    finally:
        for rid in ("early", "late"):
            engine.abort(rid)
            engine.release(rid)


def test_a_request_that_waited_for_the_loop_counts_from_its_call(engine_fp32):
    """The engine thread is busy for 0.4 s when the request comes: its arrival is the call's
    time, and its time to first token includes the wait."""

    async def main():
        ae = AsyncEngine(engine_fp32).start()
        try:
            busy = asyncio.ensure_future(ae.call(lambda engine: time.sleep(0.4)))
            await asyncio.sleep(0.05)  # the engine thread is in it
            called = time.monotonic()
            outputs = [out async for out in ae.generate("The quick brown fox", ONE, "waited")]
            await busy
        finally:
            ae.shutdown()
        first = outputs[0]
        assert called <= first.arrival_time <= called + 0.05
        assert first.first_token_time - first.arrival_time >= 0.3

    asyncio.run(main())
