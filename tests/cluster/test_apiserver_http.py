"""Server-side printing, OpenAPI discovery and the protobuf Secrets Helm writes (pure parts)."""

from __future__ import annotations

import base64
import datetime as dt

from e2e.apiserver import openapi, protobuf, resources
from e2e.apiserver.server import parse_path
from e2e.apiserver.tables import age, jsonpath, table


def test_paths_parse_like_the_kubernetes_api():
    core = parse_path("/api/v1/namespaces/ns/pods/p/status")
    assert (core.group, core.namespace, core.plural, core.name, core.subresource) == (
        "", "ns", "pods", "p", "status")
    namespace = parse_path("/api/v1/namespaces/ns")
    assert (namespace.plural, namespace.name) == ("namespaces", "ns")
    crd = parse_path("/apis/baton.dev/v1alpha1/pddeployments")
    assert (crd.group, crd.version, crd.namespace, crd.name) == ("baton.dev", "v1alpha1", None, None)
    assert parse_path("/version") is None


def test_jsonpath_filters_and_ages():
    obj = {"status": {"conditions": [{"type": "Ready", "status": "True"},
                                     {"type": "Degraded", "status": "False"}]}}
    assert jsonpath(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert jsonpath(obj, ".status.conditions[1].type") == ["Degraded"]
    assert jsonpath(obj, ".status.missing") == []
    now = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    assert age("2026-01-01T11:59:15Z", now) == "45s"
    assert age("2026-01-01T11:56:40Z", now) == "3m20s"
    assert age("2026-01-01T07:00:00Z", now) == "5h"
    assert age("2025-12-28T12:00:00Z", now) == "4d"


def test_printer_columns_become_table_cells():
    res = resources.Resource("baton.dev", "v1alpha1", "pddeployments", "PDDeployment",
                             printer_columns=({"name": "Prefill", "type": "integer",
                                               "jsonPath": ".status.prefill.ready"},
                                              {"name": "Ready", "type": "string", "jsonPath":
                                               '.status.conditions[?(@.type=="Ready")].status'}))
    obj = {"metadata": {"name": "tiny"}, "status": {"prefill": {"ready": 2},
                                                    "conditions": [{"type": "Ready", "status": "True"}]}}
    out = table(res, [obj], "None", "7")
    assert [c["name"] for c in out["columnDefinitions"]] == ["Name", "Prefill", "Ready"]
    assert out["rows"] == [{"cells": ["tiny", 2, "True"]}]


def test_openapi_says_the_server_validates_fields():
    served = list(resources.BUILTIN)
    doc = openapi.group_version(served, "apps", "v1")
    patch = doc["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"]["kind"] == "Deployment"
    assert patch["parameters"][0]["name"] == "fieldValidation"
    assert "api/v1" in openapi.index(served)["paths"]


def _field(number: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_protobuf_secret_decodes():
    meta = _field(1, b"sh.helm.release.v1.baton.v1") + _field(3, b"baton-system") + \
        _field(11, _field(1, b"owner") + _field(2, b"helm"))
    secret = _field(1, meta) + _field(2, _field(1, b"release") + _field(2, b"\x00\x01data")) + \
        _field(3, b"helm.sh/release.v1")
    body = protobuf.MAGIC + _field(1, _field(1, b"v1") + _field(2, b"Secret")) + _field(2, secret)
    decoded = protobuf.decode(body)
    assert decoded["metadata"] == {"name": "sh.helm.release.v1.baton.v1",
                                   "namespace": "baton-system", "labels": {"owner": "helm"}}
    assert base64.b64decode(decoded["data"]["release"]) == b"\x00\x01data"
    assert decoded["type"] == "helm.sh/release.v1"
    options = protobuf.MAGIC + _field(1, _field(1, b"v1") + _field(2, b"DeleteOptions")) + \
        _field(2, bytes([1 << 3, 0]) + _field(4, b"Background"))
    assert protobuf.decode(options)["propagationPolicy"] == "Background"
    assert protobuf.decode(options)["gracePeriodSeconds"] == 0
