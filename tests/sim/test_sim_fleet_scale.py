"""A 256-worker, 6-hour day: at fleet scale the controller converts several workers at once,
never more than its share of a pool, and keeps up with the hourly oracle.

The full-day numbers for 16 to 1,000 workers are `python bench/simulate_sweep.py`.
"""

import pytest

from baton.autoscaler.inputs import PolicyConfig
from baton.sim.hardware import worker_perf
from baton.sim.scenario import ScenarioConfig, compare

WORKERS = 256


@pytest.fixture(scope="module")
def report():
    return compare(worker_perf("llama-3-8b", "h100"), ScenarioConfig(workers=WORKERS, hours=6)).report()


def test_large_fleet_keeps_up_with_the_hourly_oracle(report):
    assert report["ratios"]["controller_vs_oracle"] >= 0.95
    assert report["strategies"]["controller"]["slo_attainment"] >= 0.90


def test_large_fleet_converts_several_at_once_within_its_share(report):
    controller = report["strategies"]["controller"]
    assert controller["peak_conversions_in_flight"] > 1
    assert controller["peak_conversions_in_flight"] <= PolicyConfig().conversion_limit(WORKERS)


def test_large_fleet_does_not_flap(report):
    oracle = report["strategies"]["hourly_oracle"]["conversions"]
    assert report["strategies"]["controller"]["conversions"] <= 2 * oracle + 8
