"""A prefill worker's threads may run at SCHED_IDLE (server/cpu_priority.py)."""

from __future__ import annotations

import os
import threading

import pytest

from baton.server.cpu_priority import apply_priority, policy_name, priority_for, thread_policies


def test_only_a_one_process_prefill_worker_takes_its_prefill_priority():
    assert priority_for("prefill", "idle", 1) == "idle"
    assert priority_for("prefill", "normal", 1) == "normal"
    assert priority_for("decode", "idle", 1) == "normal"  # converted away: back to normal
    assert priority_for("both", "idle", 1) == "normal"
    assert priority_for("prefill", "idle", 2) == "normal"  # its other ranks would not follow


def test_an_unknown_priority_is_refused_by_name():
    with pytest.raises(ValueError, match="CPU priority must be one of .*'normal', 'idle'.* got 'low'"):
        apply_priority("low")


def test_a_thread_moves_to_idle_and_back(tmp_path):
    """On one helper thread only: `tasks` lists just its id, so the test process keeps its policy."""
    started, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (started.set(), done.wait(10)))
    thread.start()
    try:
        assert started.wait(10)
        tid = thread.native_id
        (tmp_path / str(tid)).mkdir()
        (tmp_path / "999999999").mkdir()  # a thread that has ended meanwhile is passed over
        assert apply_priority("idle", tmp_path) is None
        assert policy_name(os.sched_getscheduler(tid)) == "SCHED_IDLE"
        assert thread_policies()[tid] == os.SCHED_IDLE
        assert policy_name(os.sched_getscheduler(threading.main_thread().native_id)) == "SCHED_OTHER"
        back = apply_priority("normal", tmp_path)
        if os.geteuid() == 0:
            assert back is None and os.sched_getscheduler(tid) == os.SCHED_OTHER
        else:  # leaving SCHED_IDLE takes privilege: said, and nothing half-moved
            assert "needs root, CAP_SYS_NICE" in back and os.sched_getscheduler(tid) == os.SCHED_IDLE
    finally:
        done.set()
        thread.join(10)


def test_nowhere_to_look_is_said_not_raised(tmp_path):
    assert "no per-thread scheduling policies" in apply_priority("idle", tmp_path / "missing")
