"""What the kubelet hands a container: its env resolved from the pod, `$(VAR)` expanded in args.

Only what the operator's manifests use: literal values and downward-API field refs
(metadata.name/namespace, metadata.labels['k'], status.podIP). Expansion follows the
kubelet: `$(VAR)` of a defined variable is replaced, `$$` is a literal `$`, anything else
stays as written.
"""

from __future__ import annotations

import re
from typing import Any

_LABEL = re.compile(r"metadata\.labels\['([^']+)'\]")
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def field_value(pod: dict[str, Any], path: str) -> str:
    meta = pod["metadata"]
    label = _LABEL.fullmatch(path)
    if label:
        return (meta.get("labels") or {}).get(label.group(1), "")
    known = {"metadata.name": meta.get("name", ""),
             "metadata.namespace": meta.get("namespace", ""),
             "status.podIP": (pod.get("status") or {}).get("podIP", "")}
    if path not in known:
        raise ValueError(f"field ref {path!r} is not one this helper resolves")
    return known[path]


def container_env(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """Literal and field-ref variables; secret refs are left out (not resolvable here)."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in (var.get("valueFrom") or {}):
            env[var["name"]] = field_value(pod, var["valueFrom"]["fieldRef"]["fieldPath"])
    return env


def expand(text: str, env: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)
    return _REFERENCE.sub(one, text)


def started_args(pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
    """The argv a container of `pod` starts with, as the kubelet computes it now."""
    env = container_env(pod, container)
    return [expand(arg, env) for arg in container.get("args") or []]
