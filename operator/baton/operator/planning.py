"""Pure decisions about worker pods: what to create, drain, convert, delete. No I/O.

All state lives in the pods' labels and annotations, the spec and the controller's target
(status.target), so a restarted operator recomputes the same plan from what it reads and
carries on where the last one stopped.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from baton.api.models import PDDeploymentSpec

from . import labels
from .desired import Desired, desired_state
from .manifests.workers import pool_of, template_hash

POOL_ROLES = ("prefill", "decode")


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def format_time(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _resized(spec: PDDeploymentSpec, pod: PodView) -> bool:
    """The pod's pool now asks for another tensor-parallel size than the pod runs (the size is
    not in the template hash, which a conversion's regroup would otherwise make stale)."""
    return pod.tensor_parallel is not None and pod.tensor_parallel != pool_of(spec, pod.role).tensor_parallel_size


@dataclass(frozen=True)
class PodView:
    """The facts the operator uses about one worker pod."""

    name: str
    role: str
    state: str
    ip: str | None
    ready: bool
    phase: str
    deleting: bool
    template_hash: str | None
    drain_deadline: dt.datetime | None
    conversion_started: str | None
    created: str
    tensor_parallel: int | None = None  # its size label (None: a pod from before the label)

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PodView:
        meta = pod.get("metadata", {})
        status = pod.get("status") or {}
        pod_labels = meta.get("labels") or {}
        notes = meta.get("annotations") or {}
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        return cls(
            name=meta["name"],
            role=pod_labels.get(labels.ROLE, ""),
            state=pod_labels.get(labels.STATE, labels.STATE_ACTIVE),
            ip=status.get("podIP") or None,
            ready=ready and status.get("phase", "Running") == "Running",
            phase=status.get("phase", "Pending"),
            deleting=bool(meta.get("deletionTimestamp")),
            template_hash=notes.get(labels.TEMPLATE_HASH),
            drain_deadline=parse_time(notes.get(labels.DRAIN_DEADLINE)),
            conversion_started=notes.get(labels.CONVERSION_STARTED),
            created=meta.get("creationTimestamp") or "",
            tensor_parallel=_int_or_none(pod_labels.get(labels.TENSOR_PARALLEL)),
        )

    @property
    def dead(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def serving(self) -> bool:
        return self.ready and self.state == labels.STATE_ACTIVE


@dataclass
class PodPlan:
    delete_now: list[PodView] = field(default_factory=list)  # dead: nothing to drain
    create: dict[str, int] = field(default_factory=dict)  # role -> new pods
    convert: list[tuple[PodView, str]] = field(default_factory=list)  # (pod, target role)
    start_removal: list[PodView] = field(default_factory=list)  # drain, then delete
    removing: list[PodView] = field(default_factory=list)  # already draining for removal
    targets: dict[str, str] = field(default_factory=dict)  # pod -> role it is or will be

    @property
    def in_flight(self) -> bool:
        return bool(self.delete_now or self.create or self.convert or self.start_removal
                    or self.removing)


def target_roles(desired: Desired, pods: list[PodView]) -> dict[str, str]:
    return {p.name: desired.conversions.get(p.name, p.role) for p in pods}


def _removal_order(pod: PodView) -> tuple:
    # Cheapest first: not serving, then the newest (least warm prefix cache).
    return (pod.serving, -_stamp(pod.created))


def _stamp(created: str) -> float:
    moment = parse_time(created)
    return moment.timestamp() if moment else 0.0


def plan_pods(spec: PDDeploymentSpec, observed: list[PodView],
              desired: Desired | None = None) -> PodPlan:
    """desired: the pool sizes and conversions to reach (default: the spec's sizes)."""
    desired = desired or desired_state(spec, None)
    plan = PodPlan()
    alive = [p for p in observed if not p.deleting]
    plan.targets = target_roles(desired, alive)
    kept: list[PodView] = []
    for pod in alive:
        target = plan.targets[pod.name]
        if pod.dead:
            plan.delete_now.append(pod)
        elif target != pod.role and target in POOL_ROLES:
            plan.convert.append((pod, target))
            kept.append(pod)
        elif pod.state != labels.STATE_ACTIVE:
            plan.removing.append(pod)  # draining with no conversion asked: on its way out
        else:
            kept.append(pod)

    converting = {pod.name for pod, _ in plan.convert}
    for role in sorted({plan.targets[p.name] for p in kept} | set(POOL_ROLES)):
        members = [p for p in kept if plan.targets[p.name] == role]
        wanted = desired.replicas(role)
        if len(members) < wanted:
            plan.create[role] = wanted - len(members)
        elif len(members) > wanted:
            candidates = sorted((p for p in members if p.name not in converting), key=_removal_order)
            plan.start_removal.extend(candidates[: len(members) - wanted])

    stale = [p for p in kept if p.name not in converting and p.name not in _removal_names(plan)
             and (p.template_hash != template_hash(spec, p.role) or _resized(spec, p))]
    # An outdated pod that does not serve (a broken image, a crash loop, still loading)
    # holds nothing: replace it now, or a fix to the spec could never reach it.
    plan.start_removal.extend(p for p in stale if not p.serving)
    serving_stale = sorted((p for p in stale if p.serving), key=lambda p: p.name)
    if serving_stale and not plan.in_flight and all(p.serving for p in kept):
        # Roll serving pods one at a time, and only while everything else serves.
        plan.start_removal.append(serving_stale[0])
    return plan


def _removal_names(plan: PodPlan) -> set[str]:
    return {p.name for p in plan.start_removal}


def drain_expired(pod: PodView, now: dt.datetime) -> bool:
    return pod.drain_deadline is not None and now >= pod.drain_deadline


def worker_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def migration_peers(pods: list[PodView], leaving: set[str], port: int) -> list[str]:
    """Where a draining decode worker may move its running sequences: the decode workers
    that serve and are not themselves leaving (draining, converting, removed)."""
    return [worker_url(p.ip, port) for p in sorted(pods, key=lambda p: p.name)
            if p.role == "decode" and p.serving and p.ip and not p.deleting
            and p.name not in leaving]


def leaving_pods(plan: PodPlan) -> set[str]:
    """Pods the plan takes out of the decode pool's service: nobody migrates to them."""
    return ({p.name for p in plan.start_removal} | {p.name for p in plan.removing}
            | {p.name for p, _ in plan.convert} | {p.name for p in plan.delete_now})
