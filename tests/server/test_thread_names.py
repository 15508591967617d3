"""A worker's threads carry their Python names at the OS level (server/thread_names.py)."""

from __future__ import annotations

import threading
from pathlib import Path

from baton.server.thread_names import COMM_BYTES, name_os_threads, os_thread_name


def comm_names(pid: int | str) -> set[str]:
    tasks = Path(f"/proc/{pid}/task")
    return {(task / "comm").read_text().strip() for task in tasks.iterdir()}


def test_a_name_is_cut_to_what_the_kernel_keeps():
    assert os_thread_name("baton-kv-receiver") == "baton-kv-receiv"
    assert len(os_thread_name("x" * 40)) == COMM_BYTES
    assert os_thread_name("baton-engine") == "baton-engine"


def test_a_live_thread_gets_its_python_name():
    started, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (started.set(), done.wait(10)), name="baton-test-renamed-thread")
    thread.start()
    try:
        assert started.wait(10)
        renamed = name_os_threads()
        assert renamed[thread.native_id] == "baton-test-rena"
        assert threading.main_thread().native_id not in renamed  # the process keeps its name
        assert Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip() == "baton-test-rena"
    finally:
        done.set()
        thread.join(10)


def test_nowhere_to_write_renames_nothing(tmp_path):
    assert name_os_threads(tmp_path / "missing") == {}


def test_a_running_worker_shows_its_engine_and_kv_threads_by_name(cluster):
    pid = cluster["decode-tcp"].proc.pid
    names = comm_names(pid)
    assert {"baton-engine", "baton-kv-receiv"} <= names, names
    assert Path(f"/proc/{pid}/comm").read_text().strip() != "MainThread"  # ps still shows the program
