"""Label and field selectors as the API server parses them (pure).

Labels: `a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a`, `!a`, comma-separated (AND).
Fields: `path=value` / `path!=value` on dotted paths such as metadata.name or spec.nodeName.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Matcher = Callable[[dict[str, Any]], bool]

_SET = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(notin|in)\s*\(([^)]*)\))?\s*$")
_EQ = re.compile(r"^\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$")


def _split(selector: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def _term(text: str) -> Callable[[dict[str, str]], bool]:
    eq = _EQ.match(text)
    if eq:
        key, op, value = eq.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    found = _SET.match(text)
    if not found:
        raise ValueError(f"unable to parse requirement: {text!r}")
    negated, key, op, values = found.groups()
    if op:
        allowed = {v.strip() for v in values.split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in allowed
        return lambda labels: labels.get(key) not in allowed
    if negated:
        return lambda labels: key not in labels
    return lambda labels: key in labels


def label_matcher(selector: str | None) -> Matcher:
    terms = [_term(t) for t in _split(selector or "")]
    return lambda obj: all(t((obj.get("metadata") or {}).get("labels") or {}) for t in terms)


def field_value(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "" if node is None else str(node)


def field_matcher(selector: str | None) -> Matcher:
    terms = []
    for text in _split(selector or ""):
        found = _EQ.match(text)
        if not found:
            raise ValueError(f"invalid field selector: {text!r}")
        path, op, value = found.groups()
        terms.append((path, op == "!=", value))
    return lambda obj: all((field_value(obj, p) != v) if neg else (field_value(obj, p) == v)
                           for p, neg, v in terms)


def label_selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels, matchExpressions) against labels; {} matches all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True
