"""`baton plan --day --workers N`: a fixed fleet over the drifting day of `baton simulate`.

From the sizing formulas alone (no simulation): the best split at each moment of the day, the
conversions per hour that following it takes, how long one conversion keeps a worker out of
service, and so (Little's law on conversions: in flight = rate x duration) the disruption
budget that pace needs, next to the budget the policy and the PodDisruptionBudget allow.
"""

from __future__ import annotations

import math

import numpy as np

from baton.autoscaler import sizing
from baton.autoscaler.inputs import PolicyConfig
from baton.operator.manifests.policy import disruption_budget
from baton.sim.hardware import WorkerPerf
from baton.sim.scenario import mix_load, provisioned_peak_rate
from baton.sim.scoring import Slo
from baton.sim.workload import DriftingDay


def conversion_seconds(perf: WorkerPerf, load: sizing.FleetLoad, split: sizing.SplitAssessment,
                       reshard_s: float) -> float:
    """Out of service per conversion: the slower drain (a decode worker migrating its sessions'
    KV over its link, or a prefill worker finishing one request) plus the reshard."""
    per_worker = split.concurrency / max(1, split.decode_workers)
    migrate = per_worker * load.resident_tokens * perf.kv_per_token / perf.link_bytes_per_s
    return max(migrate, load.prefill_service_s) + reshard_s


def hysteresis_batch(load: sizing.FleetLoad, best: sizing.SplitAssessment, workers: int, min_gain: float) -> int:
    """Workers the policy moves at once when it follows a drift: the smallest shift away from
    the best split that costs `min_gain` headroom (the policy holds inside that margin, then
    converts the whole shift), the larger of the two directions."""
    shifts = []
    for sign in (1, -1):
        k = 1
        while 1 <= best.prefill_workers + sign * k <= workers - 1:
            there = sizing.assess_split(load, best.prefill_workers + sign * k, workers - best.prefill_workers - sign * k)
            if best.headroom - there.headroom >= min_gain:
                break
            k += 1
        shifts.append(k)
    return max(shifts)


def day_plan(perf: WorkerPerf, workers: int, utilisation: float, slo: Slo, hours: float = 24.0,
             reshard_s: float = 30.0, samples_per_hour: int = 12,
             policy: PolicyConfig | None = None) -> dict:
    policy = policy or PolicyConfig()
    shape = DriftingDay(hours, 1.0)
    day = shape.with_peak_rate(provisioned_peak_rate(perf, shape, workers, utilisation, slo))
    step = 3600.0 / samples_per_hour
    times = np.arange(0.0, day.duration_s + step / 2, step)
    prefill, seconds, batches = [], [], []
    for t in times:
        load = mix_load(perf, day, float(t), slo)
        best = sizing.best_fixed_split(load, workers)
        prefill.append(best.prefill_workers)
        seconds.append(conversion_seconds(perf, load, best, reshard_s))
        batches.append(hysteresis_batch(load, best, workers, policy.min_gain))
    moves = np.abs(np.diff(prefill))
    per_hour = [int(moves[h * samples_per_hour : (h + 1) * samples_per_hour].sum())
                for h in range(math.ceil(len(moves) / samples_per_hour))]
    peak_per_hour, conversion_s = max(per_hour), max(seconds)
    # Little's law on conversions (in flight = rate x time each), or one batch at the margin.
    steady = math.ceil(peak_per_hour * conversion_s / 3600.0) if peak_per_hour else 0
    needed = max(steady, max(batches) if peak_per_hour else 0)
    smallest_pool = min(min(prefill), workers - max(prefill))
    allowed = policy.conversion_limit(smallest_pool)
    pdb_pods = math.ceil(policy.conversion_share * workers - 1e-9)
    return {
        "workers": workers, "hours": hours, "utilisation": utilisation, "peak_rate_rps": day.peak_rate,
        "min_gain": policy.min_gain,
        "split": {"start": f"{prefill[0]}P{workers - prefill[0]}D",
                  "prefill_range": [min(prefill), max(prefill)],
                  "decode_range": [workers - max(prefill), workers - min(prefill)]},
        "conversions": {"per_day": int(moves.sum()), "per_hour": per_hour, "peak_per_hour": peak_per_hour,
                        "seconds_each": conversion_s},
        "disruption_budget": {
            "needed_in_flight": needed,
            "steady_in_flight": steady,
            "batch_at_margin": max(batches),
            "policy_limit": allowed,
            "policy_share": policy.conversion_share,
            "smallest_pool": smallest_pool,
            "pdb_max_unavailable": disruption_budget(policy.conversion_share),
            "pdb_pods": pdb_pods,
            "fits": allowed <= max(1, pdb_pods),
            "batches_split": needed > allowed,
        },
    }


def render_day(plan: dict) -> str:
    s, c, b = plan["split"], plan["conversions"], plan["disruption_budget"]
    return "\n".join([
        f"{plan['workers']} workers over a {plan['hours']:g} h drifting day, peak {plan['peak_rate_rps']:.1f} req/s "
        f"at {plan['utilisation']:g} planned utilisation",
        f"split: {s['start']} at the start; prefill {s['prefill_range'][0]}-{s['prefill_range'][1]}, "
        f"decode {s['decode_range'][0]}-{s['decode_range'][1]} over the day",
        f"conversions: {c['per_day']} a day, {c['peak_per_hour']} in the busiest hour, "
        f"{c['seconds_each']:.0f} s out of service each",
        f"disruption budget: conversions/hour x seconds each / 3600 = {b['steady_in_flight']} in flight, "
        f"a batch at the {plan['min_gain']:g} headroom margin = {b['batch_at_margin']}; "
        f"the policy allows {b['policy_limit']} at once ({b['policy_share']:.0%} of the smallest pool, "
        f"{b['smallest_pool']} workers){', so larger batches are split' if b['batches_split'] else ''}; "
        f"the PodDisruptionBudget {b['pdb_max_unavailable']} = {b['pdb_pods']} pods; fits: {b['fits']}",
    ])
