"""Just enough of Kubernetes' protobuf encoding to read what Helm's release storage sends.

Helm's release storage writes Secrets with client-go's typed client, which speaks protobuf;
every other client here speaks JSON. Wire format: the "k8s\\0" magic, then a runtime.Unknown
whose `raw` field holds a core/v1 Secret (field numbers from k8s.io/api generated.proto).
"""

from __future__ import annotations

import base64
from typing import Any

MAGIC = b"k8s\x00"


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(data: bytes) -> list[tuple[int, Any]]:
    """(field number, value) pairs of one message: ints for varints, bytes for the rest."""
    out, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((number, value))
    return out


def _map_entry(data: bytes) -> tuple[str, bytes]:
    entry = dict(fields(data))
    return entry.get(1, b"").decode(), entry.get(2, b"")


def _meta(data: bytes) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for number, value in fields(data):
        if number in (1, 2, 3, 6):
            meta[{1: "name", 2: "generateName", 3: "namespace", 6: "resourceVersion"}[number]] = \
                value.decode()
        elif number in (11, 12):
            key, text = _map_entry(value)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = text.decode()
        elif number == 14:
            meta.setdefault("finalizers", []).append(value.decode())
    return meta


def decode(body: bytes) -> dict[str, Any]:
    """A Secret or DeleteOptions (what Helm's storage driver sends) as the JSON it stands for."""
    if not body.startswith(MAGIC):
        raise ValueError("not a Kubernetes protobuf body")
    unknown = dict(fields(body[len(MAGIC):]))
    type_meta = dict(fields(unknown.get(1, b"")))
    kind = type_meta.get(2, b"").decode()
    if kind == "Secret":
        return _secret(unknown.get(2, b""))
    if kind == "DeleteOptions":
        return _delete_options(unknown.get(2, b""))
    raise ValueError(f"protobuf bodies are read for Secrets and DeleteOptions, not {kind!r}")


def _delete_options(raw: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
    for number, value in fields(raw):
        if number == 1:
            out["gracePeriodSeconds"] = value
        elif number == 4:
            out["propagationPolicy"] = value.decode()
    return out


def _secret(raw: bytes) -> dict[str, Any]:
    secret: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret", "metadata": {}, "data": {}}
    for number, value in fields(raw):
        if number == 1:
            secret["metadata"] = _meta(value)
        elif number == 2:
            key, data = _map_entry(value)
            secret["data"][key] = base64.b64encode(data).decode()
        elif number == 3:
            secret["type"] = value.decode()
        elif number == 5:
            secret["immutable"] = bool(value)
    return secret
