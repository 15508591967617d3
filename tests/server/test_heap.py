"""Freezing a server's startup heap: later garbage stays collectable."""

from __future__ import annotations

import ast
import gc

import pytest

from baton.server.heap import freeze_startup_heap


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # leave the test process as it was


class Node:
    def __init__(self):
        self.other = None


def cycle() -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a


def test_startup_objects_are_frozen_and_later_garbage_is_still_collected(unfrozen):
    kept = [Node() for _ in range(1000)]  # alive at startup: frozen
    report = freeze_startup_heap()
    # a frozen object that dies leaves the count: the test process's other threads (earlier
    # tests' servers) may free some between the report and this line
    assert report["frozen_objects"] >= gc.get_freeze_count() >= len(kept)
    assert report["full_collection_ms"] >= 0 and report["full_collection_after_ms"] >= 0
    for _ in range(10):
        cycle()  # garbage made while serving
    assert gc.collect() >= 20  # two Nodes (and their dicts) a cycle: none escaped into the frozen set


def test_every_started_worker_froze_its_startup_heap(cluster):
    for name, worker in cluster.items():
        lines = [line for line in worker.log_path.read_text(errors="replace").splitlines()
                 if "startup heap frozen for the collector" in line]
        assert len(lines) == 1, f"{name}: {worker.log_tail()}"
        report = ast.literal_eval(lines[0][lines[0].index("{"):])
        # the engine, tokenizer and libraries: far more than requests leave alive
        assert report["frozen_objects"] > 50_000, (name, report)
        assert report["full_collection_after_ms"] < report["full_collection_ms"], (name, report)
