"""The three patch formats of the Kubernetes API (pure).

JSON merge patch (RFC 7386) and JSON patch (RFC 6902) exactly; strategic merge patch as the
merge patch plus the one rule kubectl relies on here: lists of objects that all carry a
`name` are merged by name (containers, ports, env, volumes), and `$patch: delete` removes.
"""

from __future__ import annotations

import copy
from typing import Any

MERGE = "application/merge-patch+json"
JSON = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


class PatchError(ValueError):
    pass


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _named(items: Any) -> bool:
    return isinstance(items, list) and all(isinstance(i, dict) and "name" in i for i in items)


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue  # directives ($retainKeys, $setElementOrder) carry no data for us
        if value is None:
            out.pop(key, None)
        elif _named(value) and _named(out.get(key)):
            merged = {i["name"]: i for i in out[key]}
            order = [i["name"] for i in out[key]]
            for item in value:
                if item.get("$patch") == "delete":
                    merged.pop(item["name"], None)
                    continue
                if item["name"] not in merged:
                    order.append(item["name"])
                merged[item["name"]] = strategic_merge_patch(merged.get(item["name"]), item)
            out[key] = [merged[n] for n in order if n in merged]
        else:
            out[key] = strategic_merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list, token: str, adding: bool) -> int:
    if token == "-" and adding:
        return len(container)
    if not token.isdigit() or int(token) > len(container) - (0 if adding else 1):
        raise PatchError(f"bad list index {token!r}")
    return int(token)


def _parent(doc: Any, tokens: list[str]) -> Any:
    node = doc
    for token in tokens[:-1]:
        if isinstance(node, list):
            node = node[_index(node, token, False)]
        elif isinstance(node, dict) and token in node:
            node = node[token]
        else:
            raise PatchError(f"path not found: /{'/'.join(tokens)}")
    return node


def _get(doc: Any, tokens: list[str]) -> Any:
    if not tokens:
        return doc
    parent = _parent(doc, tokens)
    if isinstance(parent, list):
        return parent[_index(parent, tokens[-1], False)]
    if not isinstance(parent, dict) or tokens[-1] not in parent:
        raise PatchError(f"path not found: /{'/'.join(tokens)}")
    return parent[tokens[-1]]


def _remove(doc: Any, tokens: list[str]) -> Any:
    parent = _parent(doc, tokens)
    if isinstance(parent, list):
        return parent.pop(_index(parent, tokens[-1], False))
    if not isinstance(parent, dict) or tokens[-1] not in parent:
        raise PatchError(f"path not found: /{'/'.join(tokens)}")
    return parent.pop(tokens[-1])


def _add(doc: Any, tokens: list[str], value: Any) -> Any:
    if not tokens:
        return value
    parent = _parent(doc, tokens)
    if isinstance(parent, list):
        parent.insert(_index(parent, tokens[-1], True), value)
    elif isinstance(parent, dict):
        parent[tokens[-1]] = value
    else:
        raise PatchError(f"cannot add at /{'/'.join(tokens)}")
    return doc


def json_patch(target: Any, operations: list[dict[str, Any]]) -> Any:
    doc = copy.deepcopy(target)
    if not isinstance(operations, list):
        raise PatchError("a JSON patch is a list of operations")
    for op in operations:
        kind, tokens = op.get("op"), _pointer(op.get("path", ""))
        if kind == "add":
            doc = _add(doc, tokens, copy.deepcopy(op["value"]))
        elif kind == "remove":
            _remove(doc, tokens)
        elif kind == "replace":
            _get(doc, tokens)  # must exist
            if tokens:
                _remove(doc, tokens)
            doc = _add(doc, tokens, copy.deepcopy(op["value"]))
        elif kind == "test":
            if _get(doc, tokens) != op["value"]:
                raise PatchError(f"test failed at {op['path']}")
        elif kind in ("move", "copy"):
            source = _pointer(op["from"])
            value = _remove(doc, source) if kind == "move" else copy.deepcopy(_get(doc, source))
            doc = _add(doc, tokens, value)
        else:
            raise PatchError(f"unknown operation {kind!r}")
    return doc


def apply_patch(target: dict[str, Any], patch: Any, content_type: str) -> dict[str, Any]:
    kind = content_type.split(";")[0].strip()
    if kind == MERGE:
        return merge_patch(target, patch)
    if kind == JSON:
        return json_patch(target, patch)
    if kind == STRATEGIC:
        return strategic_merge_patch(target, patch)
    raise PatchError(f"unsupported patch type {kind!r}")
