"""Deployments run their pods (the ReplicaSet layer is folded in: pods are owned directly).

RollingUpdate: pods of the new template are created at once; old ones go when every new one
is ready. Recreate: old pods go first, new ones start when none is left. Pure planning in
`plan`, store writes in `reconcile`.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from e2e.apiserver.store import Store

HASH_LABEL = "pod-template-hash"


def template_hash(deployment: dict[str, Any]) -> str:
    template = deployment["spec"].get("template") or {}
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


@dataclass
class Plan:
    create: int = 0
    delete: list[str] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)


def plan(deployment: dict[str, Any], pods: list[dict[str, Any]]) -> Plan:
    """What to do for one Deployment given the pods it owns (pure)."""
    spec = deployment["spec"]
    replicas = int(spec.get("replicas", 1))
    current = template_hash(deployment)
    alive = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    new = [p for p in alive if p["metadata"].get("labels", {}).get(HASH_LABEL) == current]
    old = [p for p in alive if p not in new]
    out = Plan()
    recreate = (spec.get("strategy") or {}).get("type") == "Recreate"
    if recreate and (old or any(p not in alive for p in pods)):
        out.delete = [p["metadata"]["name"] for p in old]
    elif len(new) < replicas:
        out.create = replicas - len(new)
    elif len(new) > replicas:
        surplus = sorted(new, key=_ready)[: len(new) - replicas]  # not-ready ones first
        out.delete = [p["metadata"]["name"] for p in surplus]
    ready_new = sum(1 for p in new if _ready(p))
    if not recreate and old and ready_new >= replicas:
        out.delete += [p["metadata"]["name"] for p in old]
    ready = sum(1 for p in alive if _ready(p))
    available = ready >= replicas
    out.status = {
        "observedGeneration": deployment["metadata"].get("generation", 1),
        "replicas": len(alive), "updatedReplicas": len(new), "readyReplicas": ready,
        "availableReplicas": ready, "unavailableReplicas": max(0, replicas - ready),
        "conditions": [
            {"type": "Available", "status": "True" if available else "False",
             "reason": "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable"},
            {"type": "Progressing", "status": "True", "reason":
             "NewReplicaSetAvailable" if ready_new >= replicas and not old else "ReplicaSetUpdated"},
        ],
    }
    return out


def pod_from_template(deployment: dict[str, Any]) -> dict[str, Any]:
    template = copy.deepcopy(deployment["spec"].get("template") or {})
    meta = template.get("metadata") or {}
    name = deployment["metadata"]["name"]
    current = template_hash(deployment)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "generateName": f"{name}-{current}-",
            "labels": {**(meta.get("labels") or {}), HASH_LABEL: current},
            "annotations": dict(meta.get("annotations") or {}),
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": name,
                                 "uid": deployment["metadata"]["uid"], "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "spec": template.get("spec") or {},
    }


def reconcile(store: Store) -> None:
    pods_res = store.resource("", "v1", "pods")
    deployments = store.resource("apps", "v1", "deployments")
    pods = store.list(pods_res, None)
    for deployment in store.list(deployments, None):
        meta = deployment["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        owned = [p for p in pods if any(o.get("uid") == meta["uid"]
                                        for o in p["metadata"].get("ownerReferences") or [])]
        todo = plan(deployment, owned)
        for name in todo.delete:
            store.delete(pods_res, meta["namespace"], name)
        for _ in range(todo.create):
            store.create(pods_res, meta["namespace"], pod_from_template(deployment))
        if (deployment.get("status") or {}) != todo.status:
            store.patch(deployments, meta["namespace"], meta["name"], {"status": todo.status},
                        "application/merge-patch+json", "status")
