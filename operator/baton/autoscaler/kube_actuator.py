"""Acting on Kubernetes: the controller only edits the PDDeployment spec; the operator converts.

A conversion is one merge patch of the spec: the new pool sizes plus `conversions: [{pod,
toRole}]`, so the operator sees both at once and turns the named pod (drain, reshard,
relabel) instead of deleting one pod and creating another. Scaling patches the sizes only.
"""

from __future__ import annotations

from typing import Any

from baton.api import SpecProblem, parse_spec
from baton.api.models import PDDeploymentSpec
from baton.operator import labels
from baton.operator.kube import KubeApi
from baton.operator.planning import PodView, parse_time

from .actuator import ActuationError
from .estimate import PoolState
from .inputs import Action, Decision

SOURCE_ROLE = {Action.CONVERT_DECODE_TO_PREFILL: "decode",
               Action.CONVERT_PREFILL_TO_DECODE: "prefill"}
TARGET_ROLE = {Action.CONVERT_DECODE_TO_PREFILL: "prefill",
               Action.CONVERT_PREFILL_TO_DECODE: "decode"}


def pending_conversions(spec: PDDeploymentSpec, pods: list[PodView]) -> list[dict[str, str]]:
    """Requested conversions not yet done, as spec entries; finished or orphaned ones dropped."""
    alive = {p.name: p for p in pods if not p.deleting and not p.dead}
    return [{"pod": c.pod, "toRole": c.to_role} for c in spec.conversions
            if c.pod in alive and (alive[c.pod].role != c.to_role
                                   or alive[c.pod].state != labels.STATE_ACTIVE)]


def pool_state(spec: PDDeploymentSpec, pods: list[PodView]) -> PoolState:
    """The committed split is the spec's; in flight: pending conversions and pods not active."""
    pending = {c["pod"] for c in pending_conversions(spec, pods)}
    busy = {p.name for p in pods if not p.deleting and p.state != labels.STATE_ACTIVE}
    return PoolState(spec.prefill.replicas, spec.decode.replicas, len(pending | busy))


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


def spec_patch(spec: PDDeploymentSpec, pods: list[PodView], decision: Decision) -> dict[str, Any]:
    """The merge patch of `spec` carrying out `decision` (pure); raises ActuationError."""
    prefill, decode = decision.target
    patch: dict[str, Any] = {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}}
    if decision.action in SOURCE_ROLE:
        pending = pending_conversions(spec, pods)
        pod = pick_pod(pods, SOURCE_ROLE[decision.action], {c["pod"] for c in pending})
        if pod is None:
            raise ActuationError(f"no serving {SOURCE_ROLE[decision.action]} pod to convert")
        # A merge patch replaces lists whole, so the pending entries are written again.
        patch["conversions"] = [*pending, {"pod": pod.name, "toRole": TARGET_ROLE[decision.action]}]
    elif decision.action is not Action.SCALE_POOLS:
        raise ActuationError(f"nothing to do for {decision.action.value}")
    return {"spec": patch}


class KubernetesActuator:
    """Patches one PDDeployment through the operator's own Kubernetes client."""

    def __init__(self, api: KubeApi, namespace: str, name: str) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name

    async def _read(self) -> tuple[PDDeploymentSpec, list[PodView]]:
        body = await self.api.get("PDDeployment", self.namespace, self.name)
        if body is None:
            raise ActuationError(f"PDDeployment {self.namespace}/{self.name} is gone")
        try:
            spec = parse_spec(body.get("spec"))
        except SpecProblem as problem:
            raise ActuationError(f"invalid spec: {problem}") from None
        found = await self.api.list("Pod", self.namespace,
                                    labels.selector(self.name, labels.WORKER))
        return spec, [PodView.of(p) for p in found]

    async def pools(self) -> PoolState:
        spec, pods = await self._read()
        return pool_state(spec, pods)

    async def apply(self, decision: Decision) -> str:
        spec, pods = await self._read()
        patch = spec_patch(spec, pods, decision)
        await self.api.patch("PDDeployment", self.namespace, self.name, patch)
        prefill, decode = decision.target
        converted = patch["spec"].get("conversions")
        if converted:
            last = converted[-1]
            return f"asked the operator to convert pod {last['pod']} to {last['toRole']}"
        return f"set pools to {prefill} prefill and {decode} decode"

    async def aclose(self) -> None:
        return None  # the client belongs to the operator
