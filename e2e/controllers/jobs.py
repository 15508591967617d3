"""Jobs run one pod to completion, retried up to backoffLimit (Helm's hooks are Jobs).

Pure planning in `plan`, store writes in `reconcile`; one completion, one pod at a time.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from e2e.apiserver.store import Store, now_iso


@dataclass
class Plan:
    create: bool = False
    status: dict[str, Any] = field(default_factory=dict)


def _phase(pod: dict[str, Any]) -> str:
    return (pod.get("status") or {}).get("phase", "Pending")


def plan(job: dict[str, Any], pods: list[dict[str, Any]]) -> Plan:
    spec, status = job["spec"], dict(job.get("status") or {})
    succeeded = sum(1 for p in pods if _phase(p) == "Succeeded")
    failed = sum(1 for p in pods if _phase(p) == "Failed")
    active = sum(1 for p in pods if _phase(p) not in ("Succeeded", "Failed")
                 and not p["metadata"].get("deletionTimestamp"))
    out = Plan()
    done = any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in status.get("conditions") or [])
    new = {"startTime": status.get("startTime") or now_iso(), "active": active,
           "succeeded": succeeded, "failed": failed,
           "conditions": list(status.get("conditions") or [])}
    if not done and succeeded >= int(spec.get("completions", 1)):
        new["conditions"] = [{"type": "Complete", "status": "True", "lastTransitionTime": now_iso()}]
        new["completionTime"] = now_iso()
    elif not done and failed > int(spec.get("backoffLimit", 6)):
        new["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                              "lastTransitionTime": now_iso()}]
    elif not done and active == 0:
        out.create = True
        new["active"] = 1
    out.status = new
    return out


def pod_for(job: dict[str, Any]) -> dict[str, Any]:
    template = copy.deepcopy(job["spec"].get("template") or {})
    meta = template.get("metadata") or {}
    name = job["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": f"{name}-",
                         "labels": {**(meta.get("labels") or {}), "job-name": name,
                                    "batch.kubernetes.io/job-name": name},
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                              "uid": job["metadata"]["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": template.get("spec") or {}}


def reconcile(store: Store) -> None:
    pods_res, jobs = store.resource("", "v1", "pods"), store.resource("batch", "v1", "jobs")
    pods = store.list(pods_res, None)
    for job in store.list(jobs, None):
        meta = job["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        owned = [p for p in pods if any(o.get("uid") == meta["uid"]
                                        for o in p["metadata"].get("ownerReferences") or [])]
        todo = plan(job, owned)
        if todo.create:
            store.create(pods_res, meta["namespace"], pod_for(job))
        current = job.get("status") or {}
        if {k: v for k, v in todo.status.items() if k != "startTime"} != \
                {k: v for k, v in current.items() if k != "startTime"}:
            store.patch(jobs, meta["namespace"], meta["name"], {"status": todo.status},
                        "application/merge-patch+json", "status")
