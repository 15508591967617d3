"""What the API server fills in on create, as a real one's defaulting does (pure)."""

from __future__ import annotations

from typing import Any


def _container(c: dict[str, Any]) -> None:
    c.setdefault("imagePullPolicy", "IfNotPresent")
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    for port in c.get("ports") or []:
        port.setdefault("protocol", "TCP")


def pod_spec(spec: dict[str, Any]) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
    spec.setdefault("schedulerName", "default-scheduler")
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        _container(c)


def apply(kind: str, obj: dict[str, Any]) -> None:
    spec = obj.setdefault("spec", {}) if kind in ("Pod", "Deployment", "Service") else None
    if kind == "Pod":
        pod_spec(spec)
        obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
    elif kind == "Deployment":
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        spec.setdefault("strategy", {"type": "RollingUpdate", "rollingUpdate": {
            "maxSurge": "25%", "maxUnavailable": "25%"}})
        pod_spec(spec.setdefault("template", {}).setdefault("spec", {}))
    elif kind == "Service":
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
    elif kind == "Namespace":  # as the API server labels every namespace since 1.21
        labels = obj["metadata"].setdefault("labels", {})
        labels["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
    elif kind == "CustomResourceDefinition":
        names = obj.get("spec", {}).get("names", {})
        obj["status"] = {"acceptedNames": names, "storedVersions": [
            v["name"] for v in obj.get("spec", {}).get("versions", []) if v.get("storage")],
            "conditions": [{"type": t, "status": "True", "reason": r, "message": ""} for t, r in
                           (("NamesAccepted", "NoConflicts"), ("Established", "InitialNamesAccepted"))]}
