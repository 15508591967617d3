"""Which resources the server serves: the built-in kinds the e2e uses, plus every CRD's.

Pure data and discovery documents; the HTTP layer serves them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    subresources: frozenset[str] = frozenset()
    printer_columns: tuple[dict[str, Any], ...] = ()
    categories: tuple[str, ...] = ()
    singular: str = field(default="")
    schema: dict[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)
    scale: dict[str, str] | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str]:
        """Objects are stored once per group and plural, whatever version is asked for."""
        return (self.group, self.plural)

    @property
    def name(self) -> str:
        return self.singular or self.kind.lower()


def _r(api_version: str, plural: str, kind: str, namespaced: bool = True,
       short: tuple[str, ...] = (), subs: tuple[str, ...] = ()) -> Resource:
    group, _, version = api_version.rpartition("/")
    return Resource(group, version, plural, kind, namespaced, short, frozenset(subs))


BUILTIN: tuple[Resource, ...] = (
    _r("v1", "namespaces", "Namespace", False, ("ns",), ("status",)),
    _r("v1", "nodes", "Node", False, ("no",), ("status",)),
    _r("v1", "pods", "Pod", True, ("po",), ("status",)),
    _r("v1", "services", "Service", True, ("svc",), ("status",)),
    _r("v1", "endpoints", "Endpoints", True, ("ep",)),
    _r("v1", "secrets", "Secret"),
    _r("v1", "configmaps", "ConfigMap", True, ("cm",)),
    _r("v1", "serviceaccounts", "ServiceAccount", True, ("sa",)),
    _r("v1", "events", "Event", True, ("ev",)),
    _r("v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ("pvc",), ("status",)),
    _r("events.k8s.io/v1", "events", "Event", True, ("ev",)),
    _r("apps/v1", "deployments", "Deployment", True, ("deploy",), ("status", "scale")),
    _r("apps/v1", "replicasets", "ReplicaSet", True, ("rs",), ("status",)),
    _r("batch/v1", "jobs", "Job", True, (), ("status",)),
    _r("discovery.k8s.io/v1", "endpointslices", "EndpointSlice"),
    _r("rbac.authorization.k8s.io/v1", "roles", "Role"),
    _r("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding"),
    _r("rbac.authorization.k8s.io/v1", "clusterroles", "ClusterRole", False),
    _r("rbac.authorization.k8s.io/v1", "clusterrolebindings", "ClusterRoleBinding", False),
    _r("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("pdb",), ("status",)),
    _r("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", True, ("netpol",)),
    _r("coordination.k8s.io/v1", "leases", "Lease"),
    _r("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition",
       False, ("crd", "crds"), ("status",)),
)


def from_crd(crd: dict[str, Any]) -> list[Resource]:
    """One Resource per served version of a CustomResourceDefinition."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    out = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        subs = frozenset((version.get("subresources") or {}).keys())
        out.append(Resource(
            group=spec["group"], version=version["name"], plural=names["plural"],
            kind=names["kind"], namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            short_names=tuple(names.get("shortNames") or ()), subresources=subs,
            printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
            categories=tuple(names.get("categories") or ()),
            singular=names.get("singular") or names["kind"].lower(),
            schema=(version.get("schema") or {}).get("openAPIV3Schema"),
            scale=(version.get("subresources") or {}).get("scale")))
    return out


def api_versions() -> dict[str, Any]:
    return {"kind": "APIVersions", "apiVersion": "v1", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}]}


def _group_versions(resources: list[Resource]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for res in resources:
        if res.group and res.version not in groups.setdefault(res.group, []):
            groups[res.group].append(res.version)
    return groups


def _group(name: str, versions: list[str]) -> dict[str, Any]:
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def api_group_list(resources: list[Resource]) -> dict[str, Any]:
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [_group(g, vs) for g, vs in sorted(_group_versions(resources).items())]}


def api_group(resources: list[Resource], group: str) -> dict[str, Any] | None:
    versions = _group_versions(resources).get(group)
    if not versions:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(group, versions)}


def api_resource_list(resources: list[Resource], group: str, version: str) -> dict[str, Any] | None:
    served = [r for r in resources if r.group == group and r.version == version]
    if not served:
        return None
    entries = []
    for res in served:
        base = {"name": res.plural, "singularName": res.name, "namespaced": res.namespaced,
                "kind": res.kind, "verbs": VERBS}
        if res.short_names:
            base["shortNames"] = list(res.short_names)
        if res.categories:
            base["categories"] = list(res.categories)
        entries.append(base)
        for sub in sorted(res.subresources):
            entries.append({"name": f"{res.plural}/{sub}", "singularName": "",
                            "namespaced": res.namespaced, "kind": res.kind,
                            "verbs": ["get", "patch", "update"]})
    return {"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version, "resources": entries}
