"""Pure status computation: observed pods and plan in, the operator's part of .status out."""

from __future__ import annotations

from typing import Any

from baton.api.models import PDDeploymentSpec

from . import labels
from .desired import Desired, desired_state
from .planning import POOL_ROLES, PodPlan, PodView

# The status keys this operator owns; others (lastDecision) belong to the controller.
OWNED_KEYS = ("observedGeneration", "conditions", "prefill", "decode", "router", "conversions")


def set_conditions(previous: list[dict[str, Any]], updates: list[tuple[str, str, str, str]],
                   generation: int | None, now: str) -> list[dict[str, Any]]:
    """Merge (type, status, reason, message) updates; a transition time moves only when the
    status itself changes, as Kubernetes conventions ask."""
    by_type = {c.get("type"): c for c in previous}
    merged: list[dict[str, Any]] = []
    for kind, status, reason, message in updates:
        old = by_type.get(kind) or {}
        moved = old.get("status") != status
        merged.append({
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": now if moved or not old.get("lastTransitionTime")
            else old["lastTransitionTime"],
            "observedGeneration": generation,
        })
    return merged


def invalid_spec_status(previous: dict[str, Any], generation: int | None, message: str,
                        now: str) -> dict[str, Any]:
    conditions = set_conditions(previous.get("conditions") or [], [
        ("Ready", "False", "InvalidSpec", message),
        ("Progressing", "False", "InvalidSpec", "waiting for a valid spec"),
        ("Degraded", "True", "InvalidSpec", message),
        ("Scaling", "False", "InvalidSpec", ""),
    ], generation, now)
    return {**_owned(previous), "observedGeneration": generation, "conditions": conditions}


# Conditions an error pass writes when no earlier pass wrote them.
_BEFORE_FIRST_PASS = {"Ready": ("False", "ReconcileError", "the last reconcile failed"),
                      "Progressing": ("True", "Reconciling", "retrying"),
                      "Scaling": ("False", "ReconcileError", "")}


def error_status(previous: dict[str, Any], generation: int | None, message: str,
                 now: str) -> dict[str, Any]:
    """Degraded with the API server's refusal; the other conditions stay as they were."""
    by_type = {c.get("type"): c for c in previous.get("conditions") or []}
    updates = []
    for kind in ("Ready", "Progressing", "Degraded", "Scaling"):
        if kind == "Degraded":
            updates.append((kind, "True", "ReconcileError", message))
        elif kind in by_type:
            old = by_type[kind]
            updates.append((kind, old["status"], old.get("reason", ""), old.get("message", "")))
        else:
            updates.append((kind, *_BEFORE_FIRST_PASS[kind]))
    conditions = set_conditions(previous.get("conditions") or [], updates, generation, now)
    return {**_owned(previous), "conditions": conditions}


def _owned(status: dict[str, Any]) -> dict[str, Any]:
    return {k: status[k] for k in OWNED_KEYS if k in status}


def pool_selector(deployment: str, role: str) -> str:
    """The label selector of one pool's worker pods, as a string (the scale subresource's)."""
    wanted = {**labels.selector(deployment, labels.WORKER), labels.ROLE: role}
    return ",".join(f"{k}={v}" for k, v in wanted.items())


def compute_status(previous: dict[str, Any], generation: int | None, spec: PDDeploymentSpec,
                   pods: list[PodView], plan: PodPlan, router_ready: int,
                   now: str, *, deployment: str, desired: Desired | None = None) -> dict[str, Any]:
    desired = desired or desired_state(spec, None)
    alive = [p for p in pods if not p.deleting and not p.dead]
    pools: dict[str, dict[str, Any]] = {}
    for role in POOL_ROLES:
        members = [p for p in alive if p.role == role]
        pools[role] = {
            "desired": desired.replicas(role),
            "current": len(members),
            "ready": sum(1 for p in members if p.serving),
            "selector": pool_selector(deployment, role),
        }
    conversions = [
        {
            "pod": pod.name,
            "fromRole": pod.role,
            "toRole": target,
            "phase": "Resharding" if pod.state == labels.STATE_RESHARDING else "Draining",
            "startedAt": pod.conversion_started or now,
        }
        for pod, target in plan.convert
    ]
    scaling = bool(plan.create or plan.start_removal or plan.removing)
    all_ready = all(pools[r]["ready"] >= pools[r]["desired"] for r in POOL_ROLES)
    ready = all_ready and router_ready >= 1 and not conversions
    summary = ", ".join(f"{r} {pools[r]['ready']}/{pools[r]['desired']} ready" for r in POOL_ROLES)
    summary += f", router {router_ready}/{spec.router.replicas} ready"
    if plan.create:
        scale_reason = "ScalingUp"
    elif plan.start_removal or plan.removing:
        scale_reason = "ScalingDown"
    else:
        scale_reason = "Stable"
    conditions = set_conditions(previous.get("conditions") or [], [
        ("Ready", "True" if ready else "False", "AllReady" if ready else "NotReady", summary),
        ("Progressing", "True" if plan.in_flight or not ready else "False",
         "Reconciling" if plan.in_flight or not ready else "Complete",
         f"{len(conversions)} conversion(s) in flight" if conversions else summary),
        ("Degraded", "False", "AsExpected", ""),
        ("Scaling", "True" if scaling else "False", scale_reason,
         "; ".join(f"creating {n} {r}" for r, n in plan.create.items())
         or (f"draining {len(plan.start_removal) + len(plan.removing)} pod(s)" if scaling else "")),
    ], generation, now)
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "prefill": pools["prefill"],
        "decode": pools["decode"],
        "router": {"desired": spec.router.replicas, "current": spec.router.replicas,
                   "ready": router_ready},
        "conversions": conversions,
    }


def changed(previous: dict[str, Any], new: dict[str, Any]) -> bool:
    return _owned(previous) != _owned(new)
