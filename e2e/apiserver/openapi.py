"""The OpenAPI v3 index kubectl reads before it writes (pure).

kubectl asks whether the server validates fields itself (the `fieldValidation` query
parameter on a resource's PATCH); when it does, kubectl sends its objects as they are and
leaves the checking to the server. The documents say just that, per group version.
"""

from __future__ import annotations

from typing import Any

from .resources import Resource

FIELD_VALIDATION = {"name": "fieldValidation", "in": "query", "schema": {"type": "string"},
                    "description": "Ignore, Warn or Strict: how unknown fields are treated"}


def _prefix(group: str, version: str) -> str:
    return f"api/{version}" if not group else f"apis/{group}/{version}"


def index(resources: list[Resource]) -> dict[str, Any]:
    paths = {}
    for res in resources:
        prefix = _prefix(res.group, res.version)
        paths[prefix] = {"serverRelativeURL": f"/openapi/v3/{prefix}"}
    return {"paths": paths}


def group_version(resources: list[Resource], group: str, version: str) -> dict[str, Any] | None:
    served = [r for r in resources if r.group == group and r.version == version]
    if not served:
        return None
    paths = {}
    for res in served:
        scope = "/namespaces/{namespace}" if res.namespaced else ""
        gvk = {"group": res.group, "version": res.version, "kind": res.kind}
        paths[f"/{_prefix(group, version)}{scope}/{res.plural}/{{name}}"] = {
            "patch": {"x-kubernetes-group-version-kind": gvk,
                      "x-kubernetes-action": "patch",
                      "parameters": [FIELD_VALIDATION],
                      "responses": {"200": {"description": "OK"}}},
        }
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"},
            "paths": paths, "components": {"schemas": {}}}
