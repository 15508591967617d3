"""What the control loop hands the policy, how the policy is configured, and what it returns.

A live loop fills `Observation` from Prometheus or scraped `/metrics`; the simulator fills
it from its fleet. A value the source could not measure is None (or NaN): the policy then
holds the current split rather than guessing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from baton.autoscaler.devices import WorkerDevices, convertible_devices


class Mode(StrEnum):
    FIXED_FLEET = "fixed-fleet"  # N workers, only their roles change
    ELASTIC = "elastic"  # each pool scales within its own bounds


class Action(StrEnum):
    HOLD = "hold"
    CONVERT_DECODE_TO_PREFILL = "convert-decode-to-prefill"
    CONVERT_PREFILL_TO_DECODE = "convert-prefill-to-decode"
    SCALE_POOLS = "scale-pools"


@dataclass(frozen=True)
class Observation:
    """One period's measurements.

    arrival_rate: req/s; input_len, output_len: mean tokens per request; hit_rate: prefix
    cache hit fraction of prompt tokens; prefill_supply: prompt tok/s one prefill worker
    computes while busy; step_intercept_s, step_per_seq_s: decode step line t(B) = a + b*B
    at the current context (from `DecodeStepModel.line_at`); kv_capacity_tokens: per decode
    worker; prefill_workers, decode_workers: the committed split (each conversion in flight
    counted under its target role, as the actuators report it);
    conversions_in_flight: workers draining or resharding; now_s: loop clock in seconds;
    local_share: share of uncached prompt tokens prefilled on decode workers;
    exposed_transfer_s: measured handoff time left on the critical path;
    decode_context_tokens: measured KV tokens per running session (None: use L_in + L_out/2);
    conversion_s: seconds a conversion takes to take effect (drain + reshard until the worker
    serves in its new role), as measured on recent conversions or known for those started
    (None: not known, the configured estimate stands in);
    unreachable_workers: workers that did not answer this period, for their role or their
    metrics (the split or the traffic is a guess);
    carried: traffic inputs this window did not measure (no request finished in it while
    requests kept arriving), taken from the last window that did.
    """

    now_s: float
    prefill_workers: int
    decode_workers: int
    arrival_rate: float | None
    input_len: float | None
    output_len: float | None
    hit_rate: float | None
    prefill_supply: float | None
    step_intercept_s: float | None
    step_per_seq_s: float | None
    kv_capacity_tokens: float | None
    conversions_in_flight: int = 0
    local_share: float = 0.0
    exposed_transfer_s: float = 0.0
    decode_context_tokens: float | None = None
    conversion_s: float | None = None
    unreachable_workers: int = 0
    carried: tuple[str, ...] = ()

    def unknown_fields(self) -> list[str]:
        """Names of measurements that are missing or not finite."""
        names = [
            "arrival_rate", "input_len", "output_len", "hit_rate", "prefill_supply",
            "step_intercept_s", "step_per_seq_s", "kv_capacity_tokens",
        ]
        return [n for n in names if not _known(getattr(self, n))]


@dataclass(frozen=True)
class PolicyConfig:
    """Targets and guard rails.

    ttft_slo_s, tpot_slo_s: latency objectives; prefill_utilisation, decode_utilisation:
    planned fraction of capacity (elastic sizing); prefill_bounds, decode_bounds: (min, max)
    workers per pool; persist_periods: periods a change in the same direction must be
    wanted before acting; urgent_gain: headroom gain that acts at once; min_gain: gain below
    which we hold (headroom is relative, so the margin is the same share of any fleet);
    cooldown_s: the least quiet time after an action; the quiet time is the longer of this
    and the time to convert (`Observation.conversion_s`, else `conversion_estimate_s`) while
    the action's conversions are in flight; conversion_estimate_s: the time to convert when
    none is measured (None: the floor alone); conversion_share: share of the source pool that
    may convert at once (at least one worker); max_conversions_in_flight: an absolute cap on
    concurrent conversions, the disruption budget (None: the share alone bounds them);
    prefill_tensor_parallel, decode_tensor_parallel: ranks (devices) a worker of each pool
    runs. The controller converts workers in place, so it counts every worker at the larger
    of the two (`worker_devices`, see `autoscaler/devices.py`): a fixed fleet is a budget of
    devices, and a conversion is one worker for one worker.
    """

    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.05
    mode: Mode = Mode.FIXED_FLEET
    prefill_utilisation: float = 0.8
    decode_utilisation: float = 0.8
    prefill_bounds: tuple[int, int] = (1, 1_000_000)
    decode_bounds: tuple[int, int] = (1, 1_000_000)
    persist_periods: int = 3
    urgent_gain: float = 0.25
    min_gain: float = 0.03
    cooldown_s: float = 60.0
    conversion_estimate_s: float | None = None
    # 5%: the pool losing workers is the one with capacity to spare, and a fleet planned at
    # 80-90% utilisation keeps 10-20% headroom, so taking 5% of it out of service at once
    # cannot overload it even if the shift was misjudged. Below 20 workers this is one.
    conversion_share: float = 0.05
    max_conversions_in_flight: int | None = None
    prefill_tensor_parallel: int = 1
    decode_tensor_parallel: int = 1

    @property
    def worker_devices(self) -> WorkerDevices:
        """Devices each worker holds: the larger pool's TP, since any worker may convert."""
        return convertible_devices(self.prefill_tensor_parallel, self.decode_tensor_parallel)

    @property
    def tensor_parallel(self) -> bool:
        return self.prefill_tensor_parallel != 1 or self.decode_tensor_parallel != 1

    def conversion_limit(self, source_pool: int) -> int:
        """Conversions allowed in flight at once when converting out of `source_pool` workers."""
        limit = max(1, math.floor(self.conversion_share * source_pool + 1e-9))
        if self.max_conversions_in_flight is not None:
            limit = min(limit, self.max_conversions_in_flight)
        return limit

    def quiet_s(self, conversion_s: float | None, in_flight: int) -> float:
        """Quiet time after an action: the floor `cooldown_s`, or longer while conversions are
        in flight and converting takes longer (measured, else the configured estimate). Once
        none is in flight they have taken effect, and the floor alone remains."""
        if in_flight <= 0:
            return self.cooldown_s
        converting = conversion_s if _known(conversion_s) else self.conversion_estimate_s
        return max(self.cooldown_s, converting or 0.0)


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one period, with enough to explain it to a human.

    action: what to do now; current, desired, target: (prefill, decode) worker counts now,
    wanted by the formulas, and after this action; inputs: the observation used;
    outputs: the formula results; explanation: one sentence naming the drivers.
    """

    action: Action
    current: tuple[int, int]
    desired: tuple[int, int]
    target: tuple[int, int]
    explanation: str
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, float] = field(default_factory=dict)

    @property
    def conversions(self) -> int:
        """Workers this decision converts (role changes only; 0 for hold and scaling)."""
        if self.action in (Action.CONVERT_DECODE_TO_PREFILL, Action.CONVERT_PREFILL_TO_DECODE):
            return abs(self.target[0] - self.current[0])
        return 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["action"] = self.action.value
        return data


def _known(value: float | None) -> bool:
    return value is not None and isinstance(value, int | float) and math.isfinite(value)


def observation_to_dict(observation: Observation) -> dict[str, Any]:
    return asdict(observation)
