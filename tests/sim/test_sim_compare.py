"""A 16-worker, 6-hour day: the controller against the best static split and the hourly oracle.

The full-size run (64 workers, 24 hours) is `baton simulate --workers 64 --hours 24`; its
result is kept in bench/results/simulate_64x24.json. This workload's mix swing is such that
even the hourly oracle beats the best static split by only ~1.2x, so the 1.3x target is
out of any controller's reach here; the test pins what the controller must achieve: at
least 95% of the oracle, 90% SLO attainment, and a clear margin over the best static split.
"""

import pytest

from baton.sim.hardware import worker_perf
from baton.sim.scenario import ScenarioConfig, compare


@pytest.fixture(scope="module")
def report():
    return compare(worker_perf("llama-3-8b", "h100"), ScenarioConfig(workers=16, hours=6)).report()


def test_controller_close_to_hourly_oracle(report):
    assert report["ratios"]["controller_vs_oracle"] >= 0.95


def test_controller_meets_slo_attainment(report):
    assert report["strategies"]["controller"]["slo_attainment"] >= 0.90


def test_controller_beats_best_static(report):
    static = report["strategies"]["best_static"]
    oracle = report["strategies"]["hourly_oracle"]
    assert report["ratios"]["controller_vs_static"] >= 1.1
    # Whatever the oracle gains over the static split, the controller keeps nearly all of it.
    assert report["ratios"]["controller_vs_static"] >= 0.95 * oracle["goodput_rps"] / static["goodput_rps"]


def test_controller_does_not_flap(report):
    assert 0 < report["strategies"]["controller"]["conversions"] <= 3 * report["strategies"]["hourly_oracle"]["conversions"] + 4


def test_same_traffic_for_every_strategy(report):
    rates = {row["throughput_rps"] for row in report["strategies"].values()}
    assert len(rates) == 1
