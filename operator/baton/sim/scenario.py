"""A full comparison: build the day, provision for its peak, run the three strategies.

The peak arrival rate is not a free knob: like a capacity planner, we take the largest
peak for which the sizing formulas, at the planned utilisation, fit the whole fleet at the
hardest moment of the day. Every strategy then serves that same traffic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from baton.autoscaler import sizing
from baton.autoscaler.inputs import PolicyConfig
from baton.sim.fleet import FleetConfig
from baton.sim.hardware import WorkerPerf
from baton.sim.scoring import Scorer, Slo
from baton.sim.strategies import Outcome, best_static, hourly_oracle, run_controller
from baton.sim.workload import DriftingDay, Ticks, make_ticks


@dataclass(frozen=True)
class ScenarioConfig:
    workers: int = 64
    hours: float = 24.0
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.05
    utilisation: float = 0.85  # fleets are provisioned for their peak at 80-90%
    dt: float = 2.0
    reshard_s: float = 30.0
    period_s: float = 30.0
    seed: int = 1


@dataclass
class Comparison:
    config: ScenarioConfig
    day: DriftingDay
    ticks: Ticks
    controller: Outcome
    static: Outcome
    oracle: Outcome
    elapsed_s: float

    def report(self) -> dict:
        duration = self.day.duration_s
        result = {name: o.summary(duration) for name, o in
                  (("controller", self.controller), ("best_static", self.static), ("hourly_oracle", self.oracle))}
        result["best_static"]["split"] = self.static.name.split()[-1]
        ctrl, static, oracle = (result[k]["goodput_rps"] for k in ("controller", "best_static", "hourly_oracle"))
        ratios = {"controller_vs_static": ctrl / max(static, 1e-12), "controller_vs_oracle": ctrl / max(oracle, 1e-12)}
        return {
            "scenario": {**self.config.__dict__, "peak_rate_rps": self.day.peak_rate,
                         "classes": [c.__dict__ for c in self.day.classes]},
            "strategies": result,
            "ratios": ratios,
            "targets": {
                "controller_vs_static_ge_1.3": ratios["controller_vs_static"] >= 1.3,
                "controller_vs_oracle_ge_0.95": ratios["controller_vs_oracle"] >= 0.95,
                "slo_attainment_ge_0.9": result["controller"]["slo_attainment"] >= 0.9,
            },
            "elapsed_s": self.elapsed_s,
        }


def mix_load(perf: WorkerPerf, day: DriftingDay, t_s: float, slo: Slo) -> sizing.FleetLoad:
    """The FleetLoad the formulas see at time t: arrival-weighted means of the class mix."""
    share = np.array([1 - day.chat_share(t_s), day.chat_share(t_s)])
    classes = day.classes
    rate = float(day.rate(t_s))
    mean_in = np.array([c.mean_input for c in classes])
    mean_out = np.array([c.mean_output for c in classes])
    uncached = np.array([(1 - c.hit_rate) * c.mean_input for c in classes])
    busy = uncached / np.array([perf.prefill_tokens_per_s(v) for v in mean_in])
    context = mean_in + mean_out / 2
    resident = float((share * mean_out) @ context / (share @ mean_out))  # long outputs stay longer
    intercept = float(perf.decode_step_s(0.0, resident))
    per_seq = (float(perf.decode_step_s(64.0, resident)) - intercept) / 64.0
    return sizing.FleetLoad(
        arrival_rate=rate, input_len=float(share @ mean_in), output_len=float(share @ mean_out),
        hit_rate=float(1 - share @ uncached / (share @ mean_in)), prefill_supply=float(share @ uncached / (share @ busy)),
        step_intercept_s=intercept, step_per_seq_s=per_seq, kv_capacity_tokens=perf.kv_capacity_tokens,
        exposed_transfer_s=perf.exposed_transfer_s(float(share @ mean_in)),
        ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s, context_tokens=resident,
    )


def provisioned_peak_rate(perf: WorkerPerf, day: DriftingDay, workers: int, utilisation: float, slo: Slo) -> float:
    """Largest peak rate whose hardest moment needs at most `workers` at `utilisation`."""
    samples = np.linspace(0, day.duration_s, 97)
    big = (0, 10**9)

    def needed(peak: float) -> int:
        trial = day.with_peak_rate(peak)
        return max(sum(sizing.elastic_pool_sizes(mix_load(perf, trial, t, slo), utilisation, utilisation, big, big))
                   for t in samples)

    low, high = 0.0, 1.0
    while needed(high) <= workers:
        low, high = high, high * 2
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if needed(mid) <= workers else (low, mid)
    return low


def compare(perf: WorkerPerf, config: ScenarioConfig) -> Comparison:
    started = time.perf_counter()
    slo = Slo(config.ttft_slo_s, config.tpot_slo_s)
    shape = DriftingDay(config.hours, 1.0)
    day = shape.with_peak_rate(provisioned_peak_rate(perf, shape, config.workers, config.utilisation, slo))
    ticks = make_ticks(day, config.dt, config.seed)
    fleet_config = FleetConfig(perf, day.classes, config.dt, config.reshard_s)
    scorer = Scorer(perf, day.classes, slo, config.dt)
    policy = PolicyConfig(ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s,
                          prefill_utilisation=config.utilisation, decode_utilisation=config.utilisation)
    controller = run_controller(fleet_config, ticks, scorer, config.workers, policy, config.period_s)
    static = best_static(fleet_config, ticks, scorer, config.workers)
    oracle = hourly_oracle(fleet_config, ticks, scorer, config.workers, period_s=config.hours * 3600 / 24)
    return Comparison(config, day, ticks, controller, static, oracle, time.perf_counter() - started)
