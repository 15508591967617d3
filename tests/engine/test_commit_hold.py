"""Holding a decode step for a prompt whose KV is due (engine/commit_hold.py): the forecast
from the pace of the layers, the choice to hold, and the real engine loop holding a step
until a commit comes, within its budget, and never for a commit that does not come."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from baton.engine import SamplingParams, handoff
from baton.engine.async_engine import AsyncEngine
from baton.engine.commit_hold import MAX_HOLD_SHARE, POLL_S, Arrival, expected_in, hold_s, may_hold
from baton.engine.sequence import SequenceStatus


# -- the forecast ----------------------------------------------------------------------
def test_the_commit_is_due_after_the_layers_to_come_and_one_more():
    # 10 of 30 layers in over 27 ms: 3 ms a layer, 20 to come, then one for the LM head
    arrival = Arrival(10, 30, first_at=100.0, last_at=100.027)
    assert expected_in(arrival, now=100.027) == pytest.approx(21 * 0.003)
    assert expected_in(arrival, now=100.05) == pytest.approx(100.027 + 0.063 - 100.05)


def test_no_forecast_before_two_layers_and_none_once_stale():
    assert expected_in(Arrival(0, 30, None, None), now=1.0) is None
    assert expected_in(Arrival(1, 30, 1.0, 1.0), now=1.0) is None
    # all 30 layers in at 1 ms each: due at 1.030; a little late is due now, long late is stale
    done = Arrival(30, 30, first_at=1.0, last_at=1.029)
    assert expected_in(done, now=1.031) == 0.0
    assert expected_in(done, now=1.040) is None


def test_a_queued_commit_is_due_now():
    assert expected_in(Arrival(0, 30, None, None, committing=True), now=5.0) == 0.0


def test_hold_for_the_soonest_commit_within_the_budget_only():
    now = 10.0
    soon = Arrival(28, 30, first_at=now - 0.027, last_at=now)  # 1 ms a layer: due in 3 ms
    later = Arrival(10, 30, first_at=now - 0.009, last_at=now)  # due in 21 ms
    assert hold_s([later, soon], now, budget_s=0.010) == pytest.approx(0.003)
    assert hold_s([later], now, budget_s=0.010) == 0.0  # beyond the budget: step now
    assert hold_s([later], now, budget_s=0.030) == pytest.approx(0.021)
    assert hold_s([soon], now, budget_s=0.0) == 0.0
    assert hold_s([], now, budget_s=1.0) == 0.0
    queued = Arrival(0, 30, None, None, committing=True)
    assert hold_s([queued], now, budget_s=0.010) == POLL_S  # due now: poll for it


def test_holds_are_rationed_to_their_share_of_the_time():
    assert may_hold(recent_hold_s=0.0, recent_step_s=0.02)
    assert may_hold(recent_hold_s=MAX_HOLD_SHARE * 0.02, recent_step_s=0.02)
    assert not may_hold(recent_hold_s=MAX_HOLD_SHARE * 0.02 + 1e-4, recent_step_s=0.02)


# -- the engine loop -------------------------------------------------------------------
DECODE = SamplingParams(max_tokens=400, ignore_eos=True)
REMOTE = SamplingParams(max_tokens=4, ignore_eos=True)


class _Script:
    """A prompt arriving from a prefill worker, played by the test: the forecast says its
    commit is due `due_s` after the step that announces it."""

    def __init__(self, ae: AsyncEngine, due_s: float):
        self.ae, self.due_s = ae, due_s
        self.arrival: Arrival | None = None
        self.announced = threading.Event()
        self.steps: list[tuple[float, float, set[str]]] = []  # (start, end, request ids out)

    def forecast(self) -> list[Arrival]:
        seq = self.ae.engine.sequences.get("remote")
        if self.arrival is None or seq is None or seq.status != SequenceStatus.REMOTE:
            return []
        return [self.arrival]

    def observe(self, outputs, elapsed: float) -> None:  # on the engine thread, after a step
        end = time.monotonic()
        self.steps.append((end - elapsed, end, {o.request_id for o in outputs}))
        if len(self.steps) == 5 and self.arrival is None:  # the loop knows its step time by now
            now = time.monotonic()
            per_layer = self.due_s / 2  # 2 of 3 layers in: one to come, one for the LM head
            self.arrival = Arrival(2, 3, first_at=now - per_layer, last_at=now)
            self.announced.set()


async def _decoding(ae: AsyncEngine, script: _Script) -> None:
    """One stream decoding, and a prompt reserved for (its KV to come, as the test says)."""
    ae.step_observers.append(script.observe)
    ae.commit_forecast = script.forecast
    await ae.call(lambda e: e.add_request("The quick brown fox", DECODE, "decode"))
    await ae.call(lambda e: handoff.reserve_remote(e, e.tokenize("Once upon a time"), REMOTE, "remote"))


def _play(engine, fraction: float, due_s: float, scene, forecast=None) -> None:
    """Run `scene(ae, script)` on a real engine loop with one stream decoding and a prompt
    reserved, once the announcement is out; then every block must be back."""
    free = engine.blocks.num_free_blocks

    async def main():
        ae = AsyncEngine(engine).start()
        ae.commit_hold_fraction = fraction
        script = _Script(ae, due_s)
        try:
            await _decoding(ae, script)
            if forecast is not None:
                ae.commit_forecast = lambda: forecast(script)
            assert await asyncio.to_thread(script.announced.wait, 30)
            await scene(ae, script)
        finally:  # every sequence left (running, finished or reserved) gives its blocks back
            await ae.call(lambda e: [e.release(rid) for rid in list(e.sequences)])
            ae.shutdown()

    asyncio.run(main())
    assert engine.blocks.num_free_blocks == free and not engine.sequences


async def _steps_after(script: _Script, count: int) -> float:
    """Wait for `count` more steps (30 s at most); the seconds they took."""
    steps_then, began = len(script.steps), time.monotonic()
    while len(script.steps) < steps_then + count and time.monotonic() < began + 30:
        await asyncio.sleep(0.01)
    assert len(script.steps) >= steps_then + count, "decoding went on"
    return time.monotonic() - began


def test_a_step_waits_for_a_commit_due_within_its_budget_and_takes_it(engine_fp32):
    async def scene(ae, script):
        await asyncio.sleep(script.due_s)
        committed_at = time.monotonic()
        await ae.call(lambda e: handoff.commit_remote(e, "remote", first_token=42))
        while "remote" not in script.steps[-1][2]:
            await asyncio.sleep(0.005)
        assert ae.holds == 1, "the step after the announcement waited for the commit"
        assert ae.held_s < ae.commit_hold_fraction * ae._recent_step_s, "the commit ended the hold, not the budget"
        # the held step was the first to start after the commit, and it carried the newcomer
        after = [s for s in script.steps if s[0] >= committed_at - 0.001]
        assert "remote" in after[0][2]

    # a generous budget (the commit, not the budget, ends the hold); stale 20 ms after it is
    # due: room for a slow test thread
    _play(engine_fp32, fraction=20.0, due_s=0.02, scene=scene)


def test_a_commit_that_never_comes_costs_each_step_its_budget_at_most(engine_fp32):
    async def scene(ae, script):
        await _steps_after(script, 10)
        # the forecast went stale after a few ms: the first boundary held, no later one
        assert ae.holds == 1
        assert ae.held_s <= 0.5 * ae._recent_step_s * 2 + 0.01

    _play(engine_fp32, fraction=0.5, due_s=0.002, scene=scene)


def test_prompts_always_about_to_arrive_hold_only_a_share_of_the_steps(engine_fp32):
    """A forecast that is always 2 ms from a commit (a steady flow of prompts, or a wrong
    forecast) would hold every step for its whole budget; the ration keeps decoding going."""
    def always_due(script) -> list[Arrival]:
        if script.arrival is None:
            return []
        now = time.monotonic()
        return [Arrival(2, 3, first_at=now - 0.001, last_at=now)]  # due in 2 ms, every time

    async def scene(ae, script):
        took = await _steps_after(script, 40)
        assert ae.holds >= 2  # it does hold, now and then
        assert ae.held_s <= 2 * MAX_HOLD_SHARE * took, (ae.held_s, took)

    _play(engine_fp32, fraction=0.5, due_s=0.002, scene=scene, forecast=always_due)
