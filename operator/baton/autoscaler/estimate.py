"""From one period's FleetSnapshot to the policy's Observation (pure, with memory).

Two kinds of input are treated differently:
- traffic (arrival rate, lengths, hit rate) is this window's measurement: when the window saw
  no traffic it is unknown and the policy holds. The lengths and hit rate come from finished
  requests, which a window shorter than the requests can lack while they run (and a closed
  loop then sends no new ones either); while requests are in flight, the last window that
  measured them stands in (for at most `shape_hold_s`), and the observation says so;
- worker capacity (prefill supply, KV capacity, the decode step line) is a property of the
  hardware and model, so the last measurement stays valid while the window has no work to
  measure it with. Without it, a pool that is idle in one window could never be resized.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .inputs import Observation
from .metrics import FleetSnapshot, known
from .step_model import DecodeStepModel

MIN_KV_USAGE_FOR_CAPACITY = 0.02  # below this the usage ratio is too coarse to divide by
_TRAFFIC = ("arrival_rate", "input_len", "output_len", "hit_rate")


@dataclass(frozen=True)
class PoolState:
    """The split the actuator considers current: committed pool sizes, conversions running,
    and workers that did not say their role this period (then the split is not known);
    conversion_s: how long recent conversions took to take effect (None: none measured)."""

    prefill: int
    decode: int
    in_flight: int = 0
    unreachable: int = 0
    conversion_s: float | None = None


class ConversionTimes:
    """Durations of the conversions an actuator requested, from the request until the worker
    serves in its new role (pure: the caller passes the time).

    `seconds` is the longest of the last `keep`: a batch converting side by side takes effect
    when its slowest worker does. A conversion whose start this actuator did not see (one
    already under way when it started) is not timed.
    """

    def __init__(self, keep: int = 5) -> None:
        self._started: dict[str, float] = {}
        self._recent: deque[float] = deque(maxlen=keep)

    def started(self, name: str, now_s: float) -> None:
        self._started.setdefault(name, now_s)

    def finished(self, name: str, now_s: float) -> None:
        begun = self._started.pop(name, None)
        if begun is not None:
            self._recent.append(max(0.0, now_s - begun))

    def abandoned(self, name: str) -> None:
        self._started.pop(name, None)

    def follow(self, in_flight: set[str], now_s: float, alive: set[str] | None = None) -> None:
        """Those requested here and no longer in flight have finished, unless their worker is
        gone (not among `alive`, when given): that conversion never took effect."""
        for name in [n for n in self._started if n not in in_flight]:
            if alive is None or name in alive:
                self.finished(name, now_s)
            else:
                self.abandoned(name)

    @property
    def seconds(self) -> float | None:
        return max(self._recent) if self._recent else None


def mean_context_tokens(input_len: float | None, output_len: float | None) -> float | None:
    """Mean KV tokens of a running decode sequence: the prompt plus half the output so far."""
    if known(input_len) is None or known(output_len) is None:
        return None
    return input_len + output_len / 2


def kv_capacity_from_usage(running_per_worker: float | None, context_tokens: float | None,
                           kv_usage: float | None) -> float | None:
    """KV capacity tokens of one decode worker = resident tokens / usage ratio.

    running_per_worker: sequences; context_tokens: KV tokens each; kv_usage: used fraction.
    """
    values = [known(v) for v in (running_per_worker, context_tokens, kv_usage)]
    if any(v is None for v in values):
        return None
    running, context, usage = values
    if running <= 0 or usage < MIN_KV_USAGE_FOR_CAPACITY:
        return None
    return running * context / usage


class ObservationBuilder:
    """Keeps the decode step model and the last worker-capacity measurements.

    kv_capacity_tokens: per decode worker, when known from the engine configuration (blocks x
    block size); None takes what the decode workers report, else estimates it from KV usage.
    step_model_min_samples: decode samples the step fit needs before it is trusted.
    """

    def __init__(self, kv_capacity_tokens: float | None = None,
                 step_model: DecodeStepModel | None = None, shape_hold_s: float = 60.0) -> None:
        self.configured_kv_capacity = kv_capacity_tokens
        self.step_model = step_model or DecodeStepModel(min_samples=3)
        self.prefill_supply: float | None = None
        self.kv_capacity: float | None = kv_capacity_tokens
        self.shape_hold_s = shape_hold_s
        self._shape: tuple[dict[str, float], float] | None = None  # last measured shape, when

    def _traffic_shape(self, snap: FleetSnapshot, now_s: float) -> tuple[dict[str, float | None], tuple[str, ...]]:
        """Arrival rate, lengths and hit rate for this period, and the names taken from an
        earlier window."""
        shape = {name: known(getattr(snap, name)) for name in _TRAFFIC}
        finished = all(shape[name] is not None for name in _TRAFFIC[1:])
        if finished and shape["arrival_rate"] is not None:
            self._shape = (shape, now_s)
            return shape, ()
        arriving = (shape["arrival_rate"] or 0.0) > 0
        in_flight = arriving or (known(snap.decode_running) or 0.0) > 0
        if not in_flight or self._shape is None or now_s - self._shape[1] > self.shape_hold_s:
            return shape, ()
        # no request finished: a rate of zero arrivals is the window's blind spot too
        missing = tuple(name for name in _TRAFFIC if shape[name] is None
                        or (name == "arrival_rate" and not arriving and not finished))
        return {**shape, **{name: self._shape[0][name] for name in missing}}, missing

    def _learn(self, snap: FleetSnapshot, context: float | None) -> None:
        if snap.prefill_supply is not None:
            self.prefill_supply = snap.prefill_supply
        if context is not None:
            for sample in snap.step_samples:
                self.step_model.observe(sample.batch, context, sample.step_s)
        if self.configured_kv_capacity is None:
            # What the decode workers report is exact; usage over resident tokens is an estimate
            # (and a poor one in a window that mixes two traffic shapes).
            measured = known(snap.decode_kv_capacity) or kv_capacity_from_usage(
                snap.decode_running, context, snap.decode_kv_usage)
            if measured is not None:
                self.kv_capacity = measured

    def build(self, snap: FleetSnapshot, pools: PoolState, now_s: float) -> Observation:
        shape, carried = self._traffic_shape(snap, now_s)
        context = mean_context_tokens(shape["input_len"], shape["output_len"])
        self._learn(snap, context)
        line: tuple[float | None, float | None] = (None, None)
        if self.step_model.ready and context is not None:
            line = self.step_model.line_at(context)
        return Observation(
            now_s=now_s,
            prefill_workers=pools.prefill,
            decode_workers=pools.decode,
            arrival_rate=shape["arrival_rate"],
            input_len=shape["input_len"],
            output_len=shape["output_len"],
            hit_rate=shape["hit_rate"],
            prefill_supply=self.prefill_supply,
            step_intercept_s=line[0],
            step_per_seq_s=line[1],
            kv_capacity_tokens=self.kv_capacity,
            conversions_in_flight=pools.in_flight,
            conversion_s=pools.conversion_s,
            # a worker silent to the actuator or to the metrics source: split or traffic partial
            unreachable_workers=max(pools.unreachable, snap.unanswered),
            local_share=snap.local_share or 0.0,
            # Not on the required list: unmeasured exposure is no reason to hold, and the
            # sizing treats 0 as "handoff fully hidden".
            exposed_transfer_s=snap.exposed_transfer_s or 0.0,
            carried=carried,
        )
