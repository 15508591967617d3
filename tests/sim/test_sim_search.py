"""The split search: a grid then its neighbourhood finds what trying every split finds."""

import numpy as np

from baton.sim.fleet import FleetConfig
from baton.sim.hardware import worker_perf
from baton.sim.scenario import ScenarioConfig, provisioned_peak_rate
from baton.sim.scoring import Scorer, Slo
from baton.sim.strategies import best_static, hourly_oracle, search_splits
from baton.sim.workload import DriftingDay, make_ticks


def test_grid_then_neighbourhood_finds_a_single_peak_anywhere():
    for workers in (40, 257, 1000):
        for peak in (1, 2, workers // 3, workers - 2, workers - 1):
            evaluated = []

            def evaluate(xs, peak=peak, evaluated=evaluated):
                evaluated.append(len(xs))
                return -np.abs(xs - peak).astype(float) ** 1.5, None

            xs, best, _ = search_splits(evaluate, workers, full_search=16)
            assert xs[best] == peak
            assert sum(evaluated) <= 16 + 2 * (workers // 15 + 1) + 1  # never every split


def test_small_fleets_try_every_split():
    xs, best, _ = search_splits(lambda xs: (-np.abs(xs - 7.0), None), 40, full_search=64)
    assert list(xs) == list(range(1, 40)) and xs[best] == 7


def test_searched_static_and_oracle_match_the_exhaustive_ones():
    perf, workers, slo = worker_perf("llama-3-8b", "h100"), 24, Slo(1.0, 0.05)
    shape = DriftingDay(2.0, 1.0)
    day = shape.with_peak_rate(provisioned_peak_rate(perf, shape, workers, ScenarioConfig.utilisation, slo))
    ticks = make_ticks(day, 2.0, 1)
    config, scorer = FleetConfig(perf, day.classes, 2.0, 30.0), Scorer(perf, day.classes, slo, 2.0)
    assert best_static(config, ticks, scorer, workers, full_search=6).name == \
        best_static(config, ticks, scorer, workers).name
    searched = hourly_oracle(config, ticks, scorer, workers, period_s=1800, full_search=6)
    every = hourly_oracle(config, ticks, scorer, workers, period_s=1800)
    assert searched.score.good.sum() == every.score.good.sum()
