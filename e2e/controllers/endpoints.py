"""Services get Endpoints and EndpointSlices from the pods they select (as kube's controller)."""

from __future__ import annotations

from typing import Any

from e2e.apiserver.errors import ApiError
from e2e.apiserver.store import Store

MANAGED_BY = "endpointslice-controller.k8s.io"


def _ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _selected(service: dict[str, Any], pod: dict[str, Any]) -> bool:
    selector = service.get("spec", {}).get("selector")
    labels = pod["metadata"].get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def target_port(port: dict[str, Any], pod: dict[str, Any]) -> int | None:
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in pod.get("spec", {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == target:
                return int(p["containerPort"])
    return None


def endpoints_for(service: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """The Endpoints object of `service` (pure): one subset per distinct port mapping."""
    spec = service.get("spec") or {}
    publish_all = spec.get("publishNotReadyAddresses", False)
    subsets: dict[tuple, dict[str, Any]] = {}
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or pod["metadata"].get("deletionTimestamp") or not _selected(service, pod):
            continue
        ports = []
        for port in spec.get("ports") or []:
            number = target_port(port, pod)
            if number is not None:
                ports.append({"name": port.get("name", ""), "port": number,
                              "protocol": port.get("protocol", "TCP")})
        key = tuple((p["name"], p["port"]) for p in ports)
        subset = subsets.setdefault(key, {"addresses": [], "notReadyAddresses": [], "ports": ports})
        address = {"ip": ip, "nodeName": pod["spec"].get("nodeName"),
                   "targetRef": {"kind": "Pod", "namespace": pod["metadata"]["namespace"],
                                 "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}}
        subset["addresses" if publish_all or _ready(pod) else "notReadyAddresses"].append(address)
    out = []
    for subset in subsets.values():
        clean = {k: sorted(v, key=lambda a: a["ip"]) if k != "ports" else v
                 for k, v in subset.items() if v}
        if clean.get("addresses") or clean.get("notReadyAddresses"):
            out.append(clean)
    meta = service["metadata"]
    return {"apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                         "labels": dict(meta.get("labels") or {})},
            "subsets": out}


def slice_for(endpoints: dict[str, Any]) -> dict[str, Any]:
    """The one EndpointSlice that mirrors an Endpoints object (pure)."""
    name = endpoints["metadata"]["name"]
    items, ports = [], []
    for subset in endpoints["subsets"]:
        ports = ports or subset["ports"]
        for ready, key in ((True, "addresses"), (False, "notReadyAddresses")):
            for address in subset.get(key) or []:
                items.append({"addresses": [address["ip"]], "nodeName": address.get("nodeName"),
                              "targetRef": address["targetRef"],
                              "conditions": {"ready": ready, "serving": ready,
                                             "terminating": False}})
    labels = {**endpoints["metadata"].get("labels", {}),
              "kubernetes.io/service-name": name, "endpointslice.kubernetes.io/managed-by": MANAGED_BY}
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-local", "namespace": endpoints["metadata"]["namespace"],
                         "labels": labels},
            "addressType": "IPv4", "endpoints": items, "ports": ports}


def _upsert(store: Store, plural: tuple[str, str, str], desired: dict[str, Any],
            owner: dict[str, Any]) -> None:
    res = store.resource(*plural)
    meta = desired["metadata"]
    meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Service", "name": owner["metadata"]["name"],
                                "uid": owner["metadata"]["uid"], "controller": True,
                                "blockOwnerDeletion": True}]
    try:
        current = store.get(res, meta["namespace"], meta["name"])
    except ApiError:
        store.create(res, meta["namespace"], desired)
        return
    body = {**current, **{k: v for k, v in desired.items() if k != "metadata"}}
    body["metadata"] = {**current["metadata"], "labels": meta["labels"],
                        "ownerReferences": meta["ownerReferences"]}
    body["metadata"].pop("resourceVersion", None)
    store.replace(res, meta["namespace"], meta["name"], body)


def reconcile(store: Store) -> None:
    pods = store.list(store.resource("", "v1", "pods"), None)
    for service in store.list(store.resource("", "v1", "services"), None):
        if not service.get("spec", {}).get("selector"):
            continue  # endpoints of a selector-less Service are written by hand
        same_ns = [p for p in pods if p["metadata"]["namespace"] == service["metadata"]["namespace"]]
        endpoints = endpoints_for(service, same_ns)
        _upsert(store, ("", "v1", "endpoints"), endpoints, service)
        _upsert(store, ("discovery.k8s.io", "v1", "endpointslices"), slice_for(endpoints), service)
