"""Garbage collection: an object whose every owner is gone is deleted (background policy)."""

from __future__ import annotations

import contextlib
from typing import Any

from e2e.apiserver.errors import ApiError
from e2e.apiserver.store import Store


def orphans(objects: list[tuple[Any, dict[str, Any]]], live: set[str]) -> list[tuple[Any, dict[str, Any]]]:
    """Objects with owner references none of which is alive (pure)."""
    out = []
    for res, obj in objects:
        owners = obj["metadata"].get("ownerReferences") or []
        if owners and not any(o.get("uid") in live for o in owners):
            out.append((res, obj))
    return out


def reconcile(store: Store) -> None:
    everything = [(res, obj) for res in _one_version_each(store)
                  for obj in store.list(res, None)]
    live = {obj["metadata"]["uid"] for _, obj in everything}
    for res, obj in orphans(everything, live):
        if obj["metadata"].get("deletionTimestamp"):
            continue
        with contextlib.suppress(ApiError):
            store.delete(res, obj["metadata"].get("namespace"), obj["metadata"]["name"])


def _one_version_each(store: Store) -> list[Any]:
    seen, out = set(), []
    for res in store.served():
        if res.key not in seen:
            seen.add(res.key)
            out.append(res)
    return out
