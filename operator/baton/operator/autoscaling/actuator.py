"""Acting on Kubernetes: the controller only writes its target; the operator converts.

The target is `status.target` of the PDDeployment: the pool sizes and `conversions: [{pod,
toRole}]`, written in one patch, so the operator sees both at once and turns the named pod
(drain, reshard, relabel) instead of deleting one pod and creating another. It never
touches the spec, which belongs to the user and to whatever applies it (GitOps).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from baton.api import SpecProblem, parse_spec
from baton.autoscaler.actuator import ActuationError
from baton.autoscaler.estimate import ConversionTimes, PoolState
from baton.autoscaler.inputs import Action, Decision

from .. import labels
from ..desired import Desired, controller_target, desired_state
from ..kube import ApiError, KubeApi
from ..manifests.names import workers_policy_name
from ..planning import PodView, parse_time

SOURCE_ROLE = {Action.CONVERT_DECODE_TO_PREFILL: "decode",
               Action.CONVERT_PREFILL_TO_DECODE: "prefill"}
TARGET_ROLE = {Action.CONVERT_DECODE_TO_PREFILL: "prefill",
               Action.CONVERT_PREFILL_TO_DECODE: "decode"}


def pending_conversions(desired: Desired, pods: list[PodView]) -> list[dict[str, str]]:
    """Requested conversions not yet done, as target entries; finished or orphaned ones dropped."""
    alive = {p.name: p for p in pods if not p.deleting and not p.dead}
    return [{"pod": pod, "toRole": role} for pod, role in desired.conversions.items()
            if pod in alive and (alive[pod].role != role
                                 or alive[pod].state != labels.STATE_ACTIVE)]


def pool_state(desired: Desired, pods: list[PodView]) -> PoolState:
    """The committed split is the desired one; in flight: pending conversions and pods not
    active."""
    pending = {c["pod"] for c in pending_conversions(desired, pods)}
    busy = {p.name for p in pods if not p.deleting and p.state != labels.STATE_ACTIVE}
    return PoolState(desired.prefill, desired.decode, len(pending | busy))


def pick_pod(pods: list[PodView], role: str, excluded: set[str]) -> PodView | None:
    """The serving pod of `role` cheapest to convert: the newest (least warm prefix cache)."""
    candidates = [p for p in pods if p.role == role and p.serving and not p.deleting
                  and p.name not in excluded]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (_created(p), p.name))


def _created(pod: PodView) -> float:
    moment = parse_time(pod.created)
    return moment.timestamp() if moment else 0.0


def disruption_allowance(max_unavailable: int | str | None, pods: list[PodView]) -> int | None:
    """Worker pods the PodDisruptionBudget still lets out of service (pure).

    Its maxUnavailable (a percentage of the worker pods, rounded up as Kubernetes does) less
    the pods not serving now (draining, resharding, starting). None: no budget to respect.
    """
    alive = [p for p in pods if not p.deleting and not p.dead]
    if max_unavailable is None:
        return None
    if isinstance(max_unavailable, str) and max_unavailable.endswith("%"):
        budget = math.ceil(float(max_unavailable[:-1]) / 100 * len(alive) - 1e-9)
    else:
        budget = int(max_unavailable)
    return budget - sum(1 for p in alive if not p.serving)


def target_patch(desired: Desired, pods: list[PodView], decision: Decision,
                 allowance: int | None = None) -> dict[str, Any]:
    """The status patch writing the target that carries out `decision` (pure); raises
    ActuationError.

    A decision converting k workers names k pods at once (the newest serving ones), no more
    than the disruption `allowance` leaves; pending conversions stay in the list, so the
    operator carries them all side by side.
    """
    prefill, decode = decision.target
    pending = pending_conversions(desired, pods)
    # The target is written whole (a merge patch replaces lists), pending conversions kept.
    target: dict[str, Any] = {"prefill": prefill, "decode": decode, "conversions": pending}
    if decision.action in SOURCE_ROLE:
        wanted = max(1, decision.conversions)
        if allowance is not None:
            if allowance <= 0:
                raise ActuationError("the workers' disruption budget is spent by pods out of service")
            wanted = min(wanted, allowance)
        chosen: list[PodView] = []
        for _ in range(wanted):
            pod = pick_pod(pods, SOURCE_ROLE[decision.action],
                           {c["pod"] for c in pending} | {p.name for p in chosen})
            if pod is None:
                break
            chosen.append(pod)
        if not chosen:
            raise ActuationError(f"no serving {SOURCE_ROLE[decision.action]} pod to convert")
        # Fewer serving pods than asked: the sizes move by the conversions actually named.
        moved = len(chosen) if decision.action is Action.CONVERT_DECODE_TO_PREFILL else -len(chosen)
        target["prefill"] = decision.current[0] + moved
        target["decode"] = decision.current[1] - moved
        target["conversions"] = [*pending, *({"pod": p.name, "toRole": TARGET_ROLE[decision.action]}
                                             for p in chosen)]
    elif decision.action is not Action.SCALE_POOLS:
        raise ActuationError(f"nothing to do for {decision.action.value}")
    return {"status": {"target": target}}


class KubernetesActuator:
    """Writes one PDDeployment's status.target through the operator's own Kubernetes client.

    It times the conversions it requests, from the patch until the pod serves in its new role
    (seen at a period's `pools()`, so to within a period); those already pending when it
    started are not timed.
    """

    def __init__(self, api: KubeApi, namespace: str, name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.clock = clock
        self.times = ConversionTimes()

    async def _read(self) -> tuple[Desired, list[PodView]]:
        body = await self.api.get("PDDeployment", self.namespace, self.name)
        if body is None:
            raise ActuationError(f"PDDeployment {self.namespace}/{self.name} is gone")
        try:
            spec = parse_spec(body.get("spec"))
        except SpecProblem as problem:
            raise ActuationError(f"invalid spec: {problem}") from None
        found = await self.api.list("Pod", self.namespace,
                                    labels.selector(self.name, labels.WORKER))
        desired = desired_state(spec, controller_target(body.get("status")))
        return desired, [PodView.of(p) for p in found]

    async def pools(self) -> PoolState:
        desired, pods = await self._read()
        alive = {p.name for p in pods if not p.deleting and not p.dead}
        self.times.follow({c["pod"] for c in pending_conversions(desired, pods)}, self.clock(), alive)
        found = pool_state(desired, pods)
        return PoolState(found.prefill, found.decode, found.in_flight, found.unreachable, self.times.seconds)

    async def apply(self, decision: Decision) -> str:
        desired, pods = await self._read()
        try:
            budget = await self.api.get("PodDisruptionBudget", self.namespace, workers_policy_name(self.name))
            max_unavailable = ((budget or {}).get("spec") or {}).get("maxUnavailable")
        except ApiError:
            max_unavailable = 1  # the budget cannot be read: one conversion at a time is safe
        patch = target_patch(desired, pods, decision, disruption_allowance(max_unavailable, pods))
        await self.api.patch("PDDeployment", self.namespace, self.name, patch, sub="status")
        target = patch["status"]["target"]
        prefill, decode = target["prefill"], target["decode"]
        pending = {c["pod"] for c in pending_conversions(desired, pods)}
        new = [c for c in target["conversions"] if c["pod"] not in pending]
        for entry in new:
            self.times.started(entry["pod"], self.clock())
        if new:
            names = ", ".join(c["pod"] for c in new)
            return f"asked the operator to convert pod(s) {names} to {new[0]['toRole']}"
        return f"set pools to {prefill} prefill and {decode} decode"

    async def aclose(self) -> None:
        return None  # the client belongs to the operator
