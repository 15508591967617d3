"""The engine's step records: each step's kind, prompt tokens and time, handed to the
metrics once."""

from __future__ import annotations

from baton.engine.scheduler import ScheduledBatch
from baton.engine.stats import RECENT_STEPS, EngineStats, StepRecord
from tests.engine.test_scheduler import seq


def test_a_step_is_named_by_what_it_carried():
    assert StepRecord(4, 0, 0.02).kind == "decode"
    assert StepRecord(4, 16, 0.03).kind == "mixed"
    assert StepRecord(0, 256, 0.3).kind == "prompt"


def test_steps_are_handed_over_once_in_order_beside_the_counters():
    stats = EngineStats()
    decoding = [seq(4, "a"), seq(4, "b")]
    stats.record_step(ScheduledBatch(decodes=decoding), 0.02)
    stats.record_step(ScheduledBatch(prefills=[(seq(40, "c"), 24)], decodes=decoding), 0.05)
    stats.record_step(ScheduledBatch(prefills=[(seq(40, "d"), 40), (seq(8, "e"), 8)]), 0.2)
    assert stats.take_steps() == [StepRecord(2, 0, 0.02), StepRecord(2, 24, 0.05), StepRecord(0, 48, 0.2)]
    assert stats.take_steps() == []
    assert (stats.steps, stats.prompt_tokens, stats.generation_tokens) == (3, 72, 4)
    assert abs(stats.prefill_seconds - 0.25) < 1e-12 and abs(stats.decode_seconds - 0.02) < 1e-12


def test_an_unread_record_keeps_only_the_latest_steps():
    stats = EngineStats()
    for i in range(RECENT_STEPS + 10):
        stats.record_step(ScheduledBatch(decodes=[seq(4, "a")]), float(i))
    steps = stats.take_steps()
    assert len(steps) == RECENT_STEPS and steps[0].seconds == 10.0 and steps[-1].seconds == RECENT_STEPS + 9
