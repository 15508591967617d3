"""Read what the cluster recorded (requests, objects) for the checks a real cluster makes."""

from __future__ import annotations

import json
from typing import Any

from e2e.harness import ClusterProcess

RBAC_KINDS = {"ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings",
              "Role": "roles", "RoleBinding": "rolebindings"}
# Built-in kinds a PDDeployment or the chart creates (the CRDs' own kinds have no schema there).
BUILTIN_KINDS = ("pods", "services", "secrets", "serviceaccounts", "deployments", "roles",
                 "rolebindings", "poddisruptionbudgets", "networkpolicies", "clusterroles",
                 "clusterrolebindings")


def requests(cluster: ClusterProcess) -> list[dict[str, Any]]:
    path = cluster.dir / "state" / "requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rbac_objects(cluster: ClusterProcess) -> dict[str, list[dict[str, Any]]]:
    return {kind: cluster.get(plural, "-A")["items"] for kind, plural in RBAC_KINDS.items()}


def objects(cluster: ClusterProcess, namespaces: tuple[str, ...]) -> list[dict[str, Any]]:
    """Built-in objects in `namespaces` and the cluster-scoped ones that are part of Baton."""
    out = []
    for plural in BUILTIN_KINDS:
        for obj in cluster.get(plural, "-A")["items"]:
            meta = obj["metadata"]
            ours = meta.get("namespace") in namespaces or (
                not meta.get("namespace") and
                (meta.get("labels") or {}).get("app.kubernetes.io/part-of") == "baton")
            if ours and not (plural == "secrets" and obj.get("type") == "helm.sh/release.v1"):
                out.append(obj)
    return out


def as_written(obj: dict[str, Any]) -> dict[str, Any]:
    """The object without what the server and node report about it (status)."""
    return {k: v for k, v in obj.items() if k != "status"}
