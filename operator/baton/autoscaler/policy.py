"""The decision rule: observation -> desired (x, y) -> guarded, explained action.

Pure apart from its own memory (streak of wanted changes, time of the last action, the
observation at that action): it never reads a clock or a metric itself, so a live loop,
the simulator and the tests drive the same object with their own time and data. The quiet
time after an action is in the fleet's terms: at least the configured cooldown, and while
the action's conversions are in flight, the time a conversion takes to take effect.
"""

from __future__ import annotations

import math

from baton.autoscaler import sizing
from baton.autoscaler.devices import WorkerDevices
from baton.autoscaler.inputs import (
    Action,
    Decision,
    Mode,
    Observation,
    PolicyConfig,
    observation_to_dict,
)

_DRIVER_FIELDS = ("arrival_rate", "input_len", "output_len", "hit_rate", "prefill_supply", "step_per_seq_s")
_DRIVER_THRESHOLD = 0.10  # a relative change smaller than this is not named as a driver


class SizingPolicy:
    """Turns each period's Observation into a Decision under a PolicyConfig."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        # The streak is keyed by direction (a conversion) or by the wanted sizes (scaling): a
        # large fleet's wanted split moves by a worker or two between periods while the shift
        # itself persists. `_streak_shift` is the smallest shift wanted during the streak.
        self._streak_key: object = None
        self._streak = 0
        self._streak_shift = 0
        self._last_action_s = -math.inf
        self._reference: Observation | None = None

    def decide(self, obs: Observation) -> Decision:
        current = (obs.prefill_workers, obs.decode_workers)
        unknown = obs.unknown_fields()
        if unknown:
            self._reset_streak()
            return Decision(
                Action.HOLD, current, current, current,
                f"hold {_split(current)}: unknown inputs ({', '.join(unknown)}) keep the current split",
                observation_to_dict(obs),
            )
        if obs.unreachable_workers:
            # A silent worker would look like a pool to refill, or its traffic like a lull.
            self._reset_streak()
            return Decision(
                Action.HOLD, current, current, current,
                f"hold {_split(current)}: unreachable_workers={obs.unreachable_workers} did not "
                "answer, so the split or the traffic is not known",
                observation_to_dict(obs),
            )
        if self._reference is None:
            self._reference = obs
        load = self._load(obs)
        if self.config.mode is Mode.FIXED_FLEET:
            desired, outputs = self._fixed_fleet_target(load, current)
        else:
            desired, outputs = self._elastic_target(load, current)
        action = self._direction(current, desired)
        drivers = self._drivers(obs)
        wanted = f"{_split(current)} -> {_split(desired)}"
        pressure = (
            f"prefill at {outputs['prefill_utilisation']:.2f} and decode at "
            f"{outputs['decode_utilisation']:.2f} of capacity"
        )

        if self.config.tensor_parallel:
            outputs.update(_device_outputs(self.config.worker_devices, current, desired))
            pressure += _devices_note(self.config, current, desired)

        hold_reason, count = self._hold_reason(obs, action, desired, outputs)
        if hold_reason:
            return Decision(
                Action.HOLD, current, desired, current,
                f"hold {_split(current)} ({hold_reason}); {pressure}; {drivers}",
                observation_to_dict(obs), outputs,
            )
        self._last_action_s = obs.now_s
        self._reference = obs
        self._reset_streak()
        target = _target(current, desired, action, count, self.config.worker_devices)
        workers = "one" if count == 1 else str(count)
        plural = "" if count == 1 else "s"
        verb = {
            Action.CONVERT_DECODE_TO_PREFILL: f"convert {workers} decode worker{plural} to prefill",
            Action.CONVERT_PREFILL_TO_DECODE: f"convert {workers} prefill worker{plural} to decode",
            Action.SCALE_POOLS: f"scale pools to {_split(target)}",
        }[action]
        return Decision(
            action, current, desired, target,
            f"{verb} ({wanted}); {pressure}; {drivers}",
            observation_to_dict(obs), outputs,
        )

    def _load(self, obs: Observation) -> sizing.FleetLoad:
        return sizing.FleetLoad(
            arrival_rate=obs.arrival_rate, input_len=obs.input_len, output_len=obs.output_len,
            hit_rate=obs.hit_rate, prefill_supply=obs.prefill_supply,
            step_intercept_s=obs.step_intercept_s, step_per_seq_s=obs.step_per_seq_s,
            kv_capacity_tokens=obs.kv_capacity_tokens, exposed_transfer_s=obs.exposed_transfer_s,
            ttft_slo_s=self.config.ttft_slo_s, tpot_slo_s=self.config.tpot_slo_s,
            local_share=obs.local_share, context_tokens=obs.decode_context_tokens,
        )

    def _fixed_fleet_target(self, load: sizing.FleetLoad, current: tuple[int, int]):
        # The fleet is a device budget: the devices the current split holds.
        per_worker = self.config.worker_devices
        devices = per_worker.fleet(*current)
        min_prefill = max(1, self.config.prefill_bounds[0])
        min_decode = max(1, self.config.decode_bounds[0])
        now = sizing.assess_split(load, *current)
        best = sizing.best_split_within_devices(load, devices, per_worker, min_prefill, min_decode)
        gain = best.headroom - now.headroom if math.isfinite(now.headroom) else math.inf
        outputs = _assessment_outputs(load, now, best, gain)
        return (best.prefill_workers, best.decode_workers), outputs

    def _elastic_target(self, load: sizing.FleetLoad, current: tuple[int, int]):
        cfg = self.config
        bounds_p = (max(1, cfg.prefill_bounds[0]), cfg.prefill_bounds[1])
        bounds_d = (max(1, cfg.decode_bounds[0]), cfg.decode_bounds[1])
        desired = sizing.elastic_pool_sizes(load, cfg.prefill_utilisation, cfg.decode_utilisation, bounds_p, bounds_d)
        now = sizing.assess_split(load, *current)
        planned = sizing.assess_split(load, *desired)
        # Elastic moves are judged by size change, not headroom: scaling in lowers headroom on purpose.
        change = max(abs(d - c) / max(1, c) for d, c in zip(desired, current, strict=True))
        gain = math.inf if not now.meets_slo and desired != current else change
        return desired, _assessment_outputs(load, now, planned, gain)

    @staticmethod
    def _direction(current: tuple[int, int], desired: tuple[int, int]) -> Action:
        x, y = current
        if desired == current:
            return Action.HOLD
        if desired[0] + desired[1] != x + y:
            return Action.SCALE_POOLS
        if desired[0] > x:
            return Action.CONVERT_DECODE_TO_PREFILL
        return Action.CONVERT_PREFILL_TO_DECODE

    def _hold_reason(self, obs: Observation, action: Action, desired: tuple[int, int],
                     outputs: dict) -> tuple[str, int]:
        """Why to hold (empty: act), and how many workers to convert when acting."""
        cfg = self.config
        if action is Action.HOLD:
            self._reset_streak()
            return "the current split is already the best", 0
        gain = outputs["gain"]
        if gain < cfg.min_gain:
            self._reset_streak()
            return f"gain {gain:.3f} is inside the {cfg.min_gain:.3f} margin", 0
        converting = action is not Action.SCALE_POOLS
        key = action if converting else desired
        shift = abs(desired[0] - obs.prefill_workers)
        if key == self._streak_key:
            self._streak += 1
            self._streak_shift = min(self._streak_shift, shift)
        else:
            self._streak_key, self._streak, self._streak_shift = key, 1, shift
        in_flight = obs.conversions_in_flight
        if converting:
            source_role, source = (("decode", obs.decode_workers) if action is Action.CONVERT_DECODE_TO_PREFILL
                                   else ("prefill", obs.prefill_workers))
            limit = cfg.conversion_limit(source)
            if in_flight >= limit:
                return (f"{in_flight} conversion(s) in flight, at the limit of {limit} for "
                        f"{source} {source_role} workers", 0)
        else:
            limit = 1  # resizing waits for every conversion to finish
            if in_flight >= limit:
                return f"{in_flight} conversion(s) in flight", 0
        since = obs.now_s - self._last_action_s
        quiet = cfg.quiet_s(obs.conversion_s, in_flight)
        if since < quiet:
            why = "cooldown" if quiet <= cfg.cooldown_s else f"converting takes {quiet:.0f}s"
            return f"{why}, {quiet - since:.0f}s left", 0
        if self._streak < cfg.persist_periods and gain < cfg.urgent_gain:
            return f"wanted for {self._streak}/{cfg.persist_periods} periods", 0
        # Never more than the shift wanted throughout the streak, nor than the limit leaves.
        return "", max(1, min(self._streak_shift, limit - in_flight))

    def _reset_streak(self) -> None:
        self._streak_key, self._streak, self._streak_shift = None, 0, 0

    def _drivers(self, obs: Observation) -> str:
        """Name the inputs that moved most since the last action."""
        ref = self._reference
        moves = []
        for name in _DRIVER_FIELDS:
            before, after = getattr(ref, name), getattr(obs, name)
            if before and abs(after - before) / abs(before) >= _DRIVER_THRESHOLD:
                moves.append((abs(after - before) / abs(before), f"{name} {_fmt(before)}->{_fmt(after)}"))
        carried = f"; {', '.join(obs.carried)} carried from the last window that measured them" if obs.carried else ""
        if not moves:  # nothing moved (e.g. the first traffic seen): the traffic and the supply
            summary = ", ".join(f"{n}={_fmt(getattr(obs, n))}" for n in _DRIVER_FIELDS[:5])
            return f"inputs {summary}{carried}"
        moves.sort(reverse=True)
        return "driven by " + ", ".join(text for _, text in moves) + carried


def _assessment_outputs(load: sizing.FleetLoad, now: sizing.SplitAssessment, plan: sizing.SplitAssessment, gain: float):
    kv_bound = load.kv_capacity_tokens / max(1.0, load.resident_tokens)
    tpot_bound = sizing.tpot_bandwidth_batch_bound(load.tpot_slo_s, load.step_intercept_s, load.step_per_seq_s)
    return {
        "prefill_demand_tokens_per_s": load.prefill_demand,
        "prefill_service_s": load.prefill_service_s,
        "kv_batch_bound": kv_bound,
        "tpot_batch_bound": tpot_bound,
        "batch_cap": min(kv_bound, tpot_bound),
        "resident_context_tokens": load.resident_tokens,
        "prefill_utilisation": now.prefill_utilisation,
        "decode_utilisation": now.decode_utilisation,
        "predicted_ttft_s": now.ttft_s,
        "predicted_tpot_s": now.tpot_s,
        "concurrency": now.concurrency,
        "headroom": now.headroom,
        "desired_headroom": plan.headroom,
        "desired_ttft_s": plan.ttft_s,
        "desired_tpot_s": plan.tpot_s,
        "gain": gain,
    }


def _target(current: tuple[int, int], desired: tuple[int, int], action: Action, count: int,
            per_worker: WorkerDevices) -> tuple[int, int]:
    """The split after this action: `count` workers converted towards `desired` (each into
    as many workers as its devices hold: one, under the controller's convertible rule), or
    `desired` itself."""
    x, y = current
    if action is Action.CONVERT_DECODE_TO_PREFILL:
        return x + count * per_worker.workers_from_conversion("decode"), y - count
    if action is Action.CONVERT_PREFILL_TO_DECODE:
        return x - count, y + count * per_worker.workers_from_conversion("prefill")
    return desired


def _device_outputs(per_worker: WorkerDevices, current: tuple[int, int],
                    desired: tuple[int, int]) -> dict[str, float]:
    return {
        "prefill_devices_per_worker": float(per_worker.prefill),
        "decode_devices_per_worker": float(per_worker.decode),
        "fleet_devices": float(per_worker.fleet(*current)),
        "desired_devices": float(per_worker.fleet(*desired)),
    }


def _devices_note(config: PolicyConfig, current: tuple[int, int], desired: tuple[int, int]) -> str:
    """Pools in devices, for fleets whose workers run more than one rank."""
    per_worker = config.worker_devices
    held, wanted = per_worker.fleet(*current), per_worker.fleet(*desired)
    change = "" if wanted == held else f" -> {wanted}"
    return (f"; {held}{change} devices, {per_worker.prefill} per worker (prefill TP "
            f"{config.prefill_tensor_parallel}, decode TP {config.decode_tensor_parallel}: "
            "a convertible worker holds the larger)")


def _split(split: tuple[int, int]) -> str:
    return f"{split[0]}P{split[1]}D"


def _fmt(value: float) -> str:
    return f"{value:.3g}"
