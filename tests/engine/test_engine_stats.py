"""The engine's step records: each step's kind, prompt tokens and time, handed to the
metrics once."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import torch

from baton.engine.scheduler import ScheduledBatch
from baton.engine.stats import RECENT_STEPS, EngineStats, StepRecord, off_cpu_seconds
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


def test_time_off_the_cpu_is_the_wall_time_its_threads_did_not_run():
    assert off_cpu_seconds(0.05, 0.03) == 0.05 - 0.03  # its core ran something else for 20 ms
    assert off_cpu_seconds(0.05, 0.08) == 0.0  # threads side by side: more CPU time than wall time
    stats = EngineStats()
    stats.record_step(ScheduledBatch(decodes=[seq(4, "a")]), 0.05, off_cpu_seconds(0.05, 0.01))
    stats.record_step(ScheduledBatch(decodes=[seq(4, "a")]), 0.05)  # not measured
    assert [step.off_cpu_seconds for step in stats.take_steps()] == [0.05 - 0.01, 0.0]


@contextmanager
def on_one_core(core: int):
    """Every thread of this process (the engine's OpenMP threads too) on `core`, one
    OpenMP thread at work, then back. Two OpenMP threads on one core wait for each other at
    every barrier: 24 steps took 12 s instead of 0.6."""
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    before = {tid: os.sched_getaffinity(tid) for tid in tids}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for tid in tids:
            os.sched_setaffinity(tid, {core})
        yield
    finally:
        torch.set_num_threads(threads)
        for tid, cores in before.items():
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:
                pass


def off_cpu_share(engine) -> float:
    from baton.engine.sampling import SamplingParams

    engine.stats.take_steps()
    engine.generate("Off the CPU:", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    steps = engine.stats.take_steps()
    assert len(steps) >= 12
    assert all(0.0 <= s.off_cpu_seconds <= s.seconds for s in steps)
    return sum(s.off_cpu_seconds for s in steps) / sum(s.seconds for s in steps)


def test_a_busy_neighbour_on_the_engines_core_shows_as_time_off_the_cpu(engine_fp32):
    core = min(os.sched_getaffinity(0))
    with on_one_core(core):
        alone = off_cpu_share(engine_fp32)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            os.sched_setaffinity(hog.pid, {core})
            shared = off_cpu_share(engine_fp32)
        finally:
            hog.kill()
            hog.wait(timeout=10)
    # the scheduler gives the neighbour a fair part of the core: a large share of each step
    assert shared > 0.15 and shared > alone + 0.1, (alone, shared)
