"""RBAC as the API server authorizes it (pure): may this user do this verb on this resource?

Used on the request log: every request a component made must be allowed by the roles the
chart and the operator grant it, or the component would fail on a cluster that enforces RBAC.
"""

from __future__ import annotations

from typing import Any


def _subject_matches(subject: dict[str, Any], user: str, binding_ns: str) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_ns
        return user == f"system:serviceaccount:{namespace}:{subject['name']}"
    if kind == "User":
        return user == subject.get("name")
    if kind == "Group":
        group = subject.get("name", "")
        return (group == "system:authenticated" or
                (group == "system:serviceaccounts" and user.startswith("system:serviceaccount:")) or
                (group.startswith("system:serviceaccounts:") and
                 user.startswith(f"system:serviceaccount:{group.split(':')[2]}:")))
    return False


def rule_allows(rule: dict[str, Any], request: dict[str, Any]) -> bool:
    groups, verbs = rule.get("apiGroups") or [], rule.get("verbs") or []
    resources = rule.get("resources") or []
    names = rule.get("resourceNames") or []
    resource = request["resource"] + (f"/{request['subresource']}" if request["subresource"] else "")
    return ((request["api_group"] in groups or "*" in groups) and
            (request["verb"] in verbs or "*" in verbs) and
            (resource in resources or "*" in resources or
             (request["subresource"] and f"{request['resource']}/*" in resources)) and
            (not names or request["name"] in names))


def allowed(request: dict[str, Any], objects: dict[str, list[dict[str, Any]]]) -> bool:
    """`objects`: lists of ClusterRole, ClusterRoleBinding, Role and RoleBinding objects."""
    cluster_roles = {r["metadata"]["name"]: r for r in objects.get("ClusterRole", [])}
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in objects.get("Role", [])}
    for binding in objects.get("ClusterRoleBinding", []):
        if any(_subject_matches(s, request["user"], "") for s in binding.get("subjects") or []):
            role = cluster_roles.get(binding["roleRef"]["name"], {})
            if any(rule_allows(rule, request) for rule in role.get("rules") or []):
                return True
    for binding in objects.get("RoleBinding", []):
        namespace = binding["metadata"]["namespace"]
        if request["namespace"] != namespace:
            continue
        if not any(_subject_matches(s, request["user"], namespace) for s in binding.get("subjects") or []):
            continue
        ref = binding["roleRef"]
        role = cluster_roles.get(ref["name"], {}) if ref["kind"] == "ClusterRole" else \
            roles.get((namespace, ref["name"]), {})
        if any(rule_allows(rule, request) for rule in role.get("rules") or []):
            return True
    return False


def refused(requests: list[dict[str, Any]], objects: dict[str, list[dict[str, Any]]],
            users: set[str]) -> list[dict[str, Any]]:
    """The requests of `users` that RBAC would have refused (distinct, for a readable report)."""
    seen, out = set(), []
    for request in requests:
        if request["user"] not in users or allowed(request, objects):
            continue
        key = (request["user"], request["verb"], request["api_group"], request["resource"],
               request["subresource"], request["namespace"])
        if key not in seen:
            seen.add(key)
            out.append(request)
    return out
