"""The object store behind the API server: Kubernetes' write semantics, in memory, no I/O.

resourceVersion is one counter for the whole store; every write appends an event to the
resource's log, which watches replay from a version on. What it does as a real server does:
uid, creationTimestamp, generation bumped on spec changes, the status subresource kept apart
from the main resource, finalizers and deletionTimestamp, graceful deletion of pods bound to
a node (the node agent finishes it), optimistic concurrency on resourceVersion, CRDs that
register their resources.
"""

from __future__ import annotations

import collections
import copy
import datetime as dt
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import defaults, errors, resources
from .patches import PatchError, apply_patch
from .resources import Resource

LOG_LENGTH = 20000  # events kept per resource for watches that resume from a version
Listener = Callable[[Resource, "Event"], None]
Hook = Callable[[Resource, dict[str, Any]], None]


@dataclass(frozen=True)
class Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Store:
    def __init__(self) -> None:
        self._builtin = list(resources.BUILTIN)
        self._custom: dict[str, list[Resource]] = {}  # CRD name -> its served resources
        self._objects: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = \
            collections.defaultdict(dict)
        self._log: dict[tuple[str, str], collections.deque[Event]] = collections.defaultdict(
            lambda: collections.deque(maxlen=LOG_LENGTH))
        self._rv = 0
        self.listeners: list[Listener] = []
        self.on_create: list[Hook] = []  # mutating admission, e.g. Service IP allocation
        self.on_delete: list[Hook] = []
        for name in ("default", "kube-system", "kube-public"):
            self.create(self.resource("", "v1", "namespaces"), None,
                        {"metadata": {"name": name}})

    # --- resources ---

    def served(self) -> list[Resource]:
        return self._builtin + [r for rs in self._custom.values() for r in rs]

    def resource(self, group: str, version: str, plural: str) -> Resource:
        for res in self.served():
            if (res.group, res.version, res.plural) == (group, version, plural):
                return res
        raise errors.ApiError(404, "NotFound", f"the server could not find the requested "
                              f"resource ({group or 'core'}/{version} {plural})")

    def resource_for_kind(self, api_version: str, kind: str) -> Resource:
        for res in self.served():
            if res.api_version == api_version and res.kind == kind:
                return res
        raise errors.ApiError(404, "NotFound", f"no resource for {api_version} {kind}")

    def _register_crd(self, crd: dict[str, Any] | None, name: str) -> None:
        if crd is None:
            self._custom.pop(name, None)
        else:
            self._custom[name] = resources.from_crd(crd)

    # --- reads ---

    @property
    def version(self) -> int:
        return self._rv

    def get(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self._objects[res.key].get((namespace or "", name))
        if obj is None:
            raise errors.not_found(f"{res.plural}.{res.group}".rstrip("."), name)
        return self._view(res, obj)

    def list(self, res: Resource, namespace: str | None,
             match: Callable[[dict[str, Any]], bool] = lambda _: True) -> list[dict[str, Any]]:
        found = [self._view(res, o) for (ns, _), o in sorted(self._objects[res.key].items())
                 if (namespace is None or ns == namespace) and match(o)]
        return found

    def events_since(self, res: Resource, rv: int) -> list[Event]:
        """Events after `rv`; raises 410 Gone when the log no longer reaches back that far."""
        log = self._log[res.key]
        if log and log[0].rv > rv + 1 and len(log) == log.maxlen:
            raise errors.gone(f"too old resource version: {rv} ({log[0].rv})")
        return [e for e in log if e.rv > rv]

    def _view(self, res: Resource, obj: dict[str, Any]) -> dict[str, Any]:
        """The stored object as the requested version presents it (same data, its apiVersion)."""
        out = copy.deepcopy(obj)
        out["apiVersion"], out["kind"] = res.api_version, res.kind
        return out

    # --- writes ---

    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, res: Resource, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        event = Event(self._rv, kind, self._view(res, obj), old)
        self._log[res.key].append(event)
        for listener in list(self.listeners):
            listener(res, event)

    def _admit(self, res: Resource, obj: dict[str, Any], strict: bool) -> dict[str, Any]:
        """A custom resource is defaulted and checked against its CRD's schema and CEL rules."""
        if res.schema is None:
            return obj
        from . import crvalidation  # jsonschema and cel-python: the e2e's requirements

        try:
            return crvalidation.validate(obj, res.schema, strict)
        except ValueError as e:
            raise errors.invalid(f"{res.kind}", obj.get("metadata", {}).get("name", ""), str(e)) from e

    def create(self, res: Resource, namespace: str | None, body: dict[str, Any],
               dry_run: bool = False) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if res.namespaced:
            namespace = namespace or meta.get("namespace") or "default"
            if meta.get("namespace") not in (None, "", namespace):
                raise errors.bad_request("the namespace of the object does not match the URL")
            if (res.kind != "Namespace" and
                    ("", "namespaces") in self._objects and
                    ("", namespace) not in self._objects[("", "namespaces")]):
                raise errors.not_found("namespaces", namespace)
            meta["namespace"] = namespace
        else:
            namespace = ""
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta.get("name")
        if not name:
            raise errors.invalid(res.kind, "", "metadata.name: Required value")
        key = (namespace, name)
        if key in self._objects[res.key]:
            raise errors.already_exists(f"{res.plural}.{res.group}".rstrip("."), name)
        for field in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(field, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso(), generation=1)
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        if "status" in res.subresources:
            obj.pop("status", None)
        obj = self._admit(res, obj, strict=True)
        if dry_run:
            return self._view(res, obj)
        defaults.apply(res.kind, obj)
        for hook in self.on_create:
            hook(res, obj)
        meta["resourceVersion"] = self._bump()
        self._objects[res.key][key] = obj
        if res.kind == "CustomResourceDefinition":
            self._register_crd(obj, name)
        self._emit(res, "ADDED", obj, None)
        return self._view(res, obj)

    def _current(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self._objects[res.key].get((namespace or "", name))
        if obj is None:
            raise errors.not_found(f"{res.plural}.{res.group}".rstrip("."), name)
        return obj

    def _write(self, res: Resource, namespace: str | None, name: str, new: dict[str, Any],
               subresource: str | None, expected_rv: str | None) -> dict[str, Any]:
        old = self._current(res, namespace, name)
        if expected_rv and expected_rv != old["metadata"]["resourceVersion"]:
            raise errors.conflict(f"{res.plural}.{res.group}".rstrip("."), name)
        if subresource == "status":
            merged = copy.deepcopy(old)
            merged["status"] = new.get("status")
            if merged["status"] is None:
                merged.pop("status")
        elif subresource:
            raise errors.ApiError(404, "NotFound", f"subresource {subresource} is not served")
        else:
            merged = copy.deepcopy(new)
            if "status" in res.subresources:
                merged.pop("status", None)
                if "status" in old:
                    merged["status"] = copy.deepcopy(old["status"])
        meta = merged.setdefault("metadata", {})
        kept = ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp",
                "deletionGracePeriodSeconds", "generation")
        for field in kept:
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
            else:
                meta.pop(field, None)
        merged["apiVersion"], merged["kind"] = res.api_version, res.kind
        merged = self._admit(res, merged, strict=False)
        meta = merged["metadata"]
        if not subresource and _spec_of(merged) != _spec_of(old):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        if merged == {**old, "apiVersion": res.api_version, "kind": res.kind}:
            return self._view(res, old)  # a no-op write changes nothing, not even the version
        meta["resourceVersion"] = self._bump()
        self._objects[res.key][(namespace or "", name)] = merged
        if res.kind == "CustomResourceDefinition":
            self._register_crd(merged, name)
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not _awaits_node(res, merged):
            return self._remove(res, merged, old)
        self._emit(res, "MODIFIED", merged, old)
        return self._view(res, merged)

    def replace(self, res: Resource, namespace: str | None, name: str, body: dict[str, Any],
                subresource: str | None = None) -> dict[str, Any]:
        if subresource == "scale":
            return self._set_scale(res, namespace, name, body)
        expected = (body.get("metadata") or {}).get("resourceVersion")
        return self._write(res, namespace, name, body, subresource, expected)

    def get_scale(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any]:
        """The autoscaling/v1 Scale a CRD's scale subresource presents."""
        if res.scale is None:
            raise errors.ApiError(404, "NotFound", f"{res.plural} has no scale subresource")
        obj = self._current(res, namespace, name)
        paths = res.scale
        status: dict[str, Any] = {"replicas": _at(obj, paths.get("statusReplicasPath")) or 0}
        if paths.get("labelSelectorPath") and _at(obj, paths["labelSelectorPath"]):
            status["selector"] = _at(obj, paths["labelSelectorPath"])
        meta = obj["metadata"]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                   "creationTimestamp") if k in meta},
                "spec": {"replicas": _at(obj, paths["specReplicasPath"]) or 0}, "status": status}

    def _set_scale(self, res: Resource, namespace: str | None, name: str,
                   scale: dict[str, Any]) -> dict[str, Any]:
        current = self._view(res, self._current(res, namespace, name))
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise errors.invalid("Scale", name, "spec.replicas: must be a non-negative integer")
        node = current
        *parents, last = res.scale["specReplicasPath"].lstrip(".").split(".")  # type: ignore[index]
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = replicas
        self._write(res, namespace, name, current, None, None)
        return self.get_scale(res, namespace, name)

    def patch(self, res: Resource, namespace: str | None, name: str, patch: Any,
              content_type: str, subresource: str | None = None) -> dict[str, Any]:
        if subresource == "scale":
            try:
                scale = apply_patch(self.get_scale(res, namespace, name), patch, content_type)
            except PatchError as e:
                raise errors.ApiError(422, "Invalid", str(e)) from e
            return self._set_scale(res, namespace, name, scale)
        current = self._view(res, self._current(res, namespace, name))
        try:
            new = apply_patch(current, patch, content_type)
        except PatchError as e:
            raise errors.ApiError(422, "Invalid", str(e)) from e
        except KeyError as e:
            raise errors.bad_request(f"malformed patch: {e}") from e
        if not isinstance(new, dict):
            raise errors.bad_request("a patch must leave an object")
        expected = (patch.get("metadata") or {}).get("resourceVersion") if isinstance(patch, dict) else None
        return self._write(res, namespace, name, new, subresource, expected)

    def apply(self, res: Resource, namespace: str | None, name: str,
              config: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply, simplified: create the object, or merge the applied configuration
        into it (lists of named items by name). No field ownership, so no conflicts."""
        body = copy.deepcopy(config)
        body.setdefault("metadata", {})["name"] = name
        if (namespace or "", name) not in self._objects[res.key]:
            return self.create(res, namespace, body)
        current = self._view(res, self._current(res, namespace, name))
        return self._write(res, namespace, name,
                           apply_patch(current, body, "application/strategic-merge-patch+json"),
                           None, None)

    def delete(self, res: Resource, namespace: str | None, name: str,
               grace_seconds: int | None = None) -> dict[str, Any]:
        obj = self._current(res, namespace, name)
        meta = obj["metadata"]
        graceful = _awaits_node(res, obj) and grace_seconds != 0
        if meta.get("finalizers") or graceful:
            if meta.get("deletionTimestamp"):
                return self._view(res, obj)
            old = copy.deepcopy(obj)
            meta["deletionTimestamp"] = now_iso()
            if res.kind == "Pod":
                default = obj.get("spec", {}).get("terminationGracePeriodSeconds", 30)
                meta["deletionGracePeriodSeconds"] = default if grace_seconds is None else grace_seconds
            meta["resourceVersion"] = self._bump()
            self._emit(res, "MODIFIED", obj, old)
            return self._view(res, obj)
        return self._remove(res, obj, copy.deepcopy(obj))

    def _remove(self, res: Resource, obj: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        del self._objects[res.key][(meta.get("namespace", ""), meta["name"])]
        if res.kind == "CustomResourceDefinition":
            self._register_crd(None, meta["name"])
        for hook in self.on_delete:
            hook(res, obj)
        meta["resourceVersion"] = self._bump()
        self._emit(res, "DELETED", obj, old)
        return self._view(res, obj)


def _at(obj: dict[str, Any], path: str | None) -> Any:
    node: Any = obj
    for part in (path or "").lstrip(".").split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _spec_of(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _awaits_node(res: Resource, obj: dict[str, Any]) -> bool:
    """A pod bound to a node is deleted gracefully: the node stops it, then removes it."""
    return res.kind == "Pod" and bool(obj.get("spec", {}).get("nodeName"))
