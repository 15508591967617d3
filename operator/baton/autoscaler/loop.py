"""The control loop: every period measure, decide, act, and explain the decision.

Explanations go three ways: `Controller.status` (a dict shaped like the PDDeployment's
status.lastDecision), the `on_decision` callback (Kubernetes Events, logs) and the
`baton_autoscaler_*` metrics.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from .actuator import ActuationError, Actuator
from .estimate import ObservationBuilder, PoolState
from .inputs import Action, Decision, Observation
from .instruments import metrics_for
from .metrics import FleetSnapshot, MetricsSource, MetricsUnavailable
from .policy import SizingPolicy

log = logging.getLogger(__name__)

# Called with the decision and its status record after each period.
DecisionCallback = Callable[[Decision, dict[str, Any]], Awaitable[None] | None]

NOTHING_MEASURED = FleetSnapshot(
    arrival_rate=None, input_len=None, output_len=None, hit_rate=None, prefill_supply=None,
    exposed_transfer_s=None, decode_kv_usage=None, decode_running=None,
)


def finite_numbers(values: dict[str, Any]) -> dict[str, float]:
    """Only the finite numeric entries (bools excluded): what status and JSON can carry."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def decision_record(decision: Decision, moment: dt.datetime, applied: str | None = None,
                    error: str | None = None) -> dict[str, Any]:
    """A decision shaped as status.lastDecision (the API's SizingDecision, camelCase keys).

    Only the model's fields: the API server prunes anything else. The split before, wanted and
    after go into the outputs; what the actuator did (or why not) into the reason.
    """
    outputs = finite_numbers(decision.outputs)
    for name, split in (("current", decision.current), ("desired", decision.desired),
                        ("target", decision.target)):
        outputs[f"{name}_prefill_workers"] = float(split[0])
        outputs[f"{name}_decode_workers"] = float(split[1])
    reason = "; ".join(part for part in (decision.explanation, applied, error) if part)
    return {
        "time": _stamp(moment),
        "action": decision.action.value,
        "reason": reason,
        "inputs": finite_numbers(decision.inputs),
        "outputs": outputs,
    }


class Controller:
    """One deployment's loop. `step()` runs one period; `run()` repeats it until stopped.

    deployment: the label on the metrics; period_s: seconds between periods; clock: the
    policy's time in seconds (monotonic); wall: timestamps for humans.
    """

    def __init__(self, deployment: str, source: MetricsSource, policy: SizingPolicy,
                 actuator: Actuator, period_s: float = 30.0,
                 builder: ObservationBuilder | None = None,
                 registry: CollectorRegistry | None = None,
                 on_decision: DecisionCallback | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        self.deployment = deployment
        self.source = source
        self.policy = policy
        self.actuator = actuator
        self.period_s = period_s
        self.builder = builder or ObservationBuilder()
        self.metrics = metrics_for(registry)
        self.on_decision = on_decision
        self.clock = clock
        self.wall = wall
        self.status: dict[str, Any] = {}  # the last decision_record
        self.last_error: str | None = None  # why the last period could not decide, if so
        self.last_applied: str | None = None  # what the actuator did in the last period, if anything
        self.periods = 0
        self.metrics.start(deployment)

    async def _measure(self) -> tuple[FleetSnapshot, str | None]:
        try:
            return await self.source.snapshot(), None
        except MetricsUnavailable as error:
            # Not fatal: every input is unknown this period, so the policy holds.
            return NOTHING_MEASURED, str(error)

    async def _pools(self, snap: FleetSnapshot) -> PoolState | None:
        found = await self.actuator.pools()
        if found is not None:
            return found
        if not snap.pools:
            return None
        return PoolState(snap.pools.get("prefill", 0), snap.pools.get("decode", 0))

    async def step(self) -> Decision | None:
        """One period. Returns the decision, or None when not even the split was known."""
        snap, problem = await self._measure()
        pools = await self._pools(snap)
        if pools is None:
            self.last_error = problem or "no workers found"
            return None
        obs: Observation = self.builder.build(snap, pools, self.clock())
        decision = self.policy.decide(obs)
        applied, error = None, problem
        if decision.action is not Action.HOLD:
            try:
                applied = await self.actuator.apply(decision)
            except ActuationError as failure:
                error = f"{decision.action.value} not carried out: {failure}"
                log.warning("%s: %s", self.deployment, error)
        self.periods += 1
        self.last_error, self.last_applied = error, applied
        self.metrics.record(self.deployment, decision, obs)
        self.status = decision_record(decision, self.wall(), applied, error)
        log.info("%s: %s", self.deployment, decision.explanation)
        if self.on_decision is not None:
            outcome = self.on_decision(decision, self.status)
            if inspect.isawaitable(outcome):
                await outcome
        return decision

    async def run(self, stopped: asyncio.Event) -> None:
        """Run periods until `stopped` is set; a failing period is logged, never fatal."""
        while not stopped.is_set():
            started = self.clock()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("autoscaler period of %s failed", self.deployment)
            remaining = self.period_s - (self.clock() - started)
            if remaining > 0:
                try:
                    await asyncio.wait_for(stopped.wait(), remaining)
                except TimeoutError:
                    pass

    async def aclose(self) -> None:
        self.metrics.forget(self.deployment)
        await self.source.aclose()
        await self.actuator.aclose()


def _stamp(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
