"""The controller's quiet time in the simulator: it waits for its conversions to take effect
when converting takes longer than its cooldown, and the cooldown alone when it does not."""

import numpy as np

from baton.autoscaler.inputs import PolicyConfig
from baton.sim.fleet import FleetConfig
from baton.sim.hardware import worker_perf
from baton.sim.scenario import provisioned_peak_rate
from baton.sim.scoring import Scorer, Slo
from baton.sim.strategies import run_controller
from baton.sim.workload import DriftingDay, make_ticks

WORKERS, HOURS = 256, 4


def _gaps(reshard_s: float, cooldown_s: float) -> np.ndarray:
    perf, slo = worker_perf("llama-3-8b", "h100"), Slo(1.0, 0.05)
    shape = DriftingDay(HOURS, 1.0)
    day = shape.with_peak_rate(provisioned_peak_rate(perf, shape, WORKERS, 0.85, slo))
    ticks = make_ticks(day, 2.0, 1)
    policy = PolicyConfig(ttft_slo_s=1.0, tpot_slo_s=0.05, prefill_utilisation=0.85,
                          decode_utilisation=0.85, cooldown_s=cooldown_s)
    outcome = run_controller(FleetConfig(perf, day.classes, 2.0, reshard_s), ticks,
                             Scorer(perf, day.classes, slo, 2.0), WORKERS, policy)
    moments = np.array([d["t_s"] for d in outcome.decisions])
    assert len(moments) > 3
    return np.diff(moments)


def test_actions_wait_for_the_conversions_to_take_effect():
    # Conversions take at least the 150 s reshard, longer than the 60 s cooldown: a batch may
    # not follow the last before those conversions serve in their new roles (with a fixed
    # 60 s cooldown, batches came 90 s apart).
    assert _gaps(150.0, cooldown_s=60.0).min() >= 150.0


def test_quick_conversions_wait_for_the_cooldown_only():
    gaps = _gaps(10.0, cooldown_s=60.0)
    assert gaps.min() >= 60.0
    assert gaps.min() < 150.0  # the floor, not a longer wait, spaces quick conversions
