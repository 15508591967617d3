"""Three ways to split a fixed fleet over a day, run on identical traffic.

- controller: `baton.autoscaler.policy.SizingPolicy` sees windowed measurements every
  period and converts as many workers as it decides, paying drain and reshard time (which
  it is told, as a live actuator tells it the measured duration of recent conversions);
- best static: every split x + y = N held all day, the best one kept;
- hourly oracle: at each hour, every split is tried from the same state and the best for
  that hour is taken, re-splitting instantly and for free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from baton.autoscaler.inputs import Action, Mode, Observation, PolicyConfig
from baton.autoscaler.policy import SizingPolicy
from baton.autoscaler.step_model import DecodeStepModel
from baton.sim.fleet import DECODE, PREFILL, Fleet, FleetConfig
from baton.sim.scoring import Score, Scorer, Trace
from baton.sim.workload import Ticks


@dataclass
class Outcome:
    """One strategy's run: its trace, its score, and the decisions it took."""

    name: str
    trace: Trace
    score: Score
    conversions: int = 0
    decisions: list[dict] = field(default_factory=list)
    peak_in_flight: int = 0  # most conversions under way at once (the disruption they needed)

    def summary(self, duration_s: float) -> dict:
        arrived, good = float(self.score.arrived[:, 0].sum()), float(self.score.good[:, 0].sum())
        per_hour: dict[int, int] = {}
        for d in self.decisions:
            per_hour[int(d["t_s"] // 3600)] = per_hour.get(int(d["t_s"] // 3600), 0) + d.get("count", 0)
        return {
            "goodput_rps": good / duration_s,
            "throughput_rps": arrived / duration_s,
            "slo_attainment": good / max(1.0, arrived),
            "conversions": self.conversions,
            "peak_conversions_in_flight": self.peak_in_flight,
            "peak_conversions_per_hour": max(per_hour.values(), default=0),
            "mean_ttft_s": float(np.average(self.score.mean_ttft_s[:, 0], weights=self.score.arrived[:, 0] + 1e-12)),
            "mean_tpot_s": float(np.average(self.score.mean_tpot_s[:, 0], weights=self.score.arrived[:, 0] + 1e-12)),
        }


def run_splits(config: FleetConfig, ticks: Ticks, prefill: np.ndarray, decode: np.ndarray,
               start: Fleet | None = None, tick_range: range | None = None) -> tuple[Fleet, Trace]:
    """Run K fixed splits side by side (optionally from a fleet state, over some ticks)."""
    fleet = start or Fleet(config, prefill, decode)
    if start is not None:
        fleet.set_split(prefill, decode)
    span = tick_range or range(len(ticks.times))
    records = [fleet.step(ticks.arrivals[t]) for t in span]
    return fleet, Trace.stack(records)


# Up to this many candidate splits every one is tried; a larger fleet is searched on a grid of
# this many, then at every split within one grid step of the grid's best. Goodput is smooth and
# single-peaked in the split (either pool overloads away from the balance), so the refinement
# finds the exhaustive answer while a 1,000-worker fleet runs ~100 columns instead of 999.
FULL_SEARCH = 64

Evaluate = Callable[[np.ndarray], tuple[np.ndarray, object]]


def search_splits(evaluate: Evaluate, workers: int, full_search: int = FULL_SEARCH):
    """Best prefill count x in 1..N-1 by `evaluate(xs) -> (goodput per x, payload)`.

    Returns (xs of the last evaluation, index of the best in it, that evaluation's payload).
    """
    every = np.arange(1, workers)
    if len(every) <= full_search:
        goodput, payload = evaluate(every)
        return every, int(np.argmax(goodput)), payload
    coarse = np.unique(np.linspace(1, workers - 1, full_search).round().astype(int))
    stride = int(np.max(np.diff(coarse)))
    goodput, _ = evaluate(coarse)
    centre = int(coarse[int(np.argmax(goodput))])
    fine = np.arange(max(1, centre - stride), min(workers - 1, centre + stride) + 1)
    goodput, payload = evaluate(fine)
    return fine, int(np.argmax(goodput)), payload


def best_static(config: FleetConfig, ticks: Ticks, scorer: Scorer, workers: int,
                full_search: int = FULL_SEARCH) -> Outcome:
    def evaluate(prefill: np.ndarray):
        _, trace = run_splits(config, ticks, prefill, workers - prefill)
        score = scorer.score(trace, ticks.arrivals)
        return score.good.sum(axis=0), (trace, score)

    prefill, best, (trace, score) = search_splits(evaluate, workers, full_search)
    return Outcome(f"static {prefill[best]}P{workers - prefill[best]}D", trace.column(best),
                   _column(score, best))


def hourly_oracle(config: FleetConfig, ticks: Ticks, scorer: Scorer, workers: int,
                  period_s: float = 3600.0, full_search: int = FULL_SEARCH) -> Outcome:
    per_hour = int(round(period_s / ticks.dt))
    state = Fleet(config, [workers // 2], [workers - workers // 2])
    parts, changes, last = [], 0, None
    for begin in range(0, len(ticks.times), per_hour):
        span = range(begin, min(begin + per_hour, len(ticks.times)))

        def evaluate(prefill: np.ndarray, span=span, state=state):
            trial, trace = run_splits(config, ticks, prefill, workers - prefill,
                                      state.clone_to(len(prefill), 0), span)
            score = scorer.score(trace, ticks.arrivals[span.start : span.stop])
            return score.good.sum(axis=0), (trial, trace)

        prefill, best, (trial, trace) = search_splits(evaluate, workers, full_search)
        state = trial.clone_to(1, best)
        parts.append(trace.column(best))
        changes += abs(int(prefill[best]) - last) if last is not None else 0
        last = int(prefill[best])
    full = Trace.concat(parts)
    return Outcome("hourly oracle", full, scorer.score(full, ticks.arrivals), conversions=changes)


def run_controller(config: FleetConfig, ticks: Ticks, scorer: Scorer, workers: int,
                   policy_config: PolicyConfig, period_s: float = 30.0, window_s: float = 60.0,
                   seed: int = 11) -> Outcome:
    """Drive one fleet with the autoscaler policy, measuring only what a live loop could."""
    assert policy_config.mode is Mode.FIXED_FLEET
    perf, classes = config.perf, config.classes
    fleet = Fleet(config, [workers // 2], [workers - workers // 2])
    policy, step_model = SizingPolicy(policy_config), DecodeStepModel()
    rng = np.random.default_rng(seed)
    period, window = int(round(period_s / ticks.dt)), int(round(window_s / ticks.dt))
    means_in = np.array([c.mean_input for c in classes])
    means_out = np.array([c.mean_output for c in classes])
    hits = np.array([c.hit_rate for c in classes])
    service = config.service_s
    records, decisions, conversions, peak = [], [], 0, 0
    converting_s: float | None = None  # drain + reshard of the latest batch's slowest worker
    for t in range(len(ticks.times)):
        rec = fleet.step(ticks.arrivals[t])
        records.append(rec)
        if rec.batch[0] > 0 and np.isfinite(rec.step_s[0]):
            # Workers' batches differ around the pool mean (the fluid model keeps only the mean),
            # and each reports its own steps with timer jitter.
            for spread in rng.normal(1.0, 0.25, size=3).clip(0.2, 2.0):
                batch = rec.batch[0] * spread
                measured = float(perf.decode_step_s(batch, rec.context[0])) * (1 + 0.03 * rng.standard_normal())
                step_model.observe(batch, rec.context[0], measured)
        if (t + 1) % period or t + 1 < window:
            continue
        seen = ticks.arrivals[t + 1 - window : t + 1].sum(axis=0)
        count = seen.sum()
        prompt_tokens = seen @ means_in
        uncached = seen @ ((1 - hits) * means_in)
        ready = step_model.ready and count > 0
        context = float(rec.context[0]) if fleet.running[0].sum() > 0 else None
        line = step_model.line_at(context or float(prompt_tokens / count)) if ready else (None, None)
        committed = fleet.committed_split(0)
        obs = Observation(
            now_s=fleet.now_s, prefill_workers=committed[0], decode_workers=committed[1],
            arrival_rate=count / window_s if count else None,
            input_len=prompt_tokens / count if count else None,
            output_len=float(seen @ means_out / count) if count else None,
            hit_rate=1 - uncached / prompt_tokens if count else None,
            prefill_supply=uncached / float(seen @ service) if count else None,  # tokens per busy second
            step_intercept_s=line[0], step_per_seq_s=line[1],
            kv_capacity_tokens=perf.kv_capacity_tokens,
            conversions_in_flight=fleet.in_flight(0),
            exposed_transfer_s=perf.exposed_transfer_s(prompt_tokens / count) if count else 0.0,
            decode_context_tokens=context, conversion_s=converting_s,
        )
        decision = policy.decide(obs)
        source = {Action.CONVERT_DECODE_TO_PREFILL: DECODE, Action.CONVERT_PREFILL_TO_DECODE: PREFILL}
        downtimes = [fleet.start_conversion(0, source[decision.action]) for _ in range(decision.conversions)]
        converting_s = max(downtimes, default=converting_s)
        peak = max(peak, fleet.in_flight(0))
        if decision.action is not Action.HOLD:
            conversions += decision.conversions
            decisions.append({"t_s": fleet.now_s, "action": decision.action.value, "count": decision.conversions,
                              "target": list(decision.target), "why": decision.explanation})
    trace = Trace.stack(records)
    return Outcome("controller", trace, scorer.score(trace, ticks.arrivals), conversions, decisions, peak)


def _column(score: Score, k: int) -> Score:
    return Score(*(a[:, k : k + 1] for a in (score.arrived, score.good, score.mean_ttft_s, score.mean_tpot_s)))
