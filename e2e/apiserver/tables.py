"""Server-side printing: the Table that `kubectl get` asks for (pure).

A CRD's additionalPrinterColumns are evaluated here, as kube-apiserver does; kubectl only
lays the cells out. JSONPath: dotted fields, [n] indexes and [?(@.key=="value")] filters.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from .resources import Resource

_STEP = re.compile(r'\.([\w-]+)|\[(\d+)\]|\[\?\(@\.([\w-]+)==["\']([^"\']*)["\']\)\]')


def jsonpath(obj: Any, path: str) -> list[Any]:
    """All values `path` selects in `obj` (empty when a step finds nothing)."""
    nodes, pos = [obj], 0
    path = path.strip().removeprefix("{").removesuffix("}").strip()
    while pos < len(path):
        step = _STEP.match(path, pos)
        if step is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {pos}")
        key, index, fkey, fvalue = step.groups()
        out: list[Any] = []
        for node in nodes:
            if key is not None and isinstance(node, dict) and key in node:
                out.append(node[key])
            elif index is not None and isinstance(node, list) and int(index) < len(node):
                out.append(node[int(index)])
            elif fkey is not None and isinstance(node, list):
                out.extend(i for i in node if isinstance(i, dict) and str(i.get(fkey)) == fvalue)
        nodes, pos = out, step.end()
    return nodes


def age(timestamp: str | None, now: dt.datetime) -> str:
    """kubectl's short durations: 45s, 3m20s, 17m, 5h10m, 30h, 4d."""
    if not timestamp:
        return "<unknown>"
    then = dt.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    s = max(0, int((now - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 3 * 3600:
        return f"{s // 60}m"
    if s < 8 * 3600:
        return f"{s // 3600}h{s % 3600 // 60}m" if s % 3600 // 60 else f"{s // 3600}h"
    if s < 48 * 3600:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _pod_cells(pod: dict[str, Any]) -> list[Any]:
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    total = len(pod.get("spec", {}).get("containers") or [])
    ready = sum(1 for c in containers if c.get("ready"))
    restarts = sum(c.get("restartCount", 0) for c in containers)
    phase = status.get("phase", "Pending")
    if pod["metadata"].get("deletionTimestamp"):
        phase = "Terminating"
    else:
        for c in containers:
            waiting = (c.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason"):
                phase = waiting["reason"]
    return [f"{ready}/{total}", phase, restarts, status.get("podIP", "<none>"),
            pod.get("spec", {}).get("nodeName", "<none>")]


_POD_COLUMNS = [("Ready", "string", 0), ("Status", "string", 0), ("Restarts", "integer", 0),
                ("IP", "string", 1), ("Node", "string", 1)]


def _cell(obj: dict[str, Any], column: dict[str, Any], now: dt.datetime) -> Any:
    try:
        values = jsonpath(obj, column["jsonPath"])
    except ValueError:
        return None
    if not values:
        return None
    if column.get("type") == "date":
        return age(values[0], now)
    if len(values) == 1:
        return values[0]
    return ",".join(str(v) for v in values)


def table(res: Resource, objects: list[dict[str, Any]], include_object: str, rv: str,
          now: dt.datetime | None = None) -> dict[str, Any]:
    now = now or dt.datetime.now(dt.UTC)
    columns: list[tuple[str, str, int]] = [("Name", "string", 0)]
    if res.printer_columns:
        columns += [(c["name"], c.get("type", "string"), c.get("priority", 0))
                    for c in res.printer_columns]
    elif res.kind == "Pod":
        columns += _POD_COLUMNS[:3] + [("Age", "string", 0)] + _POD_COLUMNS[3:]
    else:
        columns.append(("Age", "string", 0))
    rows = []
    for obj in objects:
        meta = obj["metadata"]
        if res.printer_columns:
            cells = [meta["name"]] + [_cell(obj, c, now) for c in res.printer_columns]
        elif res.kind == "Pod":
            pod = _pod_cells(obj)
            cells = [meta["name"], *pod[:3], age(meta.get("creationTimestamp"), now), *pod[3:]]
        else:
            cells = [meta["name"], age(meta.get("creationTimestamp"), now)]
        row: dict[str, Any] = {"cells": cells}
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": meta}
        rows.append(row)
    return {
        "kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": rv},
        "columnDefinitions": [{"name": n, "type": t, "format": "name" if n == "Name" else "",
                               "description": "", "priority": p} for n, t, p in columns],
        "rows": rows,
    }
