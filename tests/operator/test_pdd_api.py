"""The PDDeployment API: generated CRD is current, samples pass, invalid samples fail."""

from __future__ import annotations

import argparse
from pathlib import Path

import jsonschema
import pytest
import yaml

from baton.api import SpecProblem, models, parse_spec
from baton.api.cel import rules_of
from baton.api.crd import build_crd, open_api_schema
from baton.api.crdgen import render_crd, run, targets

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
INVALID = sorted((ROOT / "crds" / "samples" / "invalid").glob("*.yaml"))


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _schema_errors(document: dict) -> list[str]:
    # OpenAPI v3 bounds use Draft 4's boolean exclusiveMinimum; x-kubernetes-* keys are ignored.
    validator = jsonschema.Draft4Validator(open_api_schema())
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(document)]


def _cel_errors(document: dict) -> list[str]:
    try:
        parse_spec(document.get("spec"))
    except SpecProblem as problem:
        return [f"{path}: {message}" for path, message in problem.problems]
    return []


def test_committed_crd_is_current():
    text = render_crd()
    for path in targets(ROOT):
        assert path.exists(), f"{path} missing: run `baton crds`"
        assert path.read_text() == text, f"{path} is stale: run `baton crds`"


def test_crds_command_check_and_write(tmp_path):
    assert run(argparse.Namespace(root=tmp_path, check=True)) == 1
    assert run(argparse.Namespace(root=tmp_path, check=False)) == 0
    assert run(argparse.Namespace(root=tmp_path, check=True)) == 0
    assert yaml.safe_load(targets(tmp_path)[0].read_text()) == build_crd()


def test_crd_shape():
    crd = build_crd()
    assert crd["metadata"]["name"] == "pddeployments.baton.dev"
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["shortNames"] == ["pdd"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and set(version["subresources"]) == {"status", "scale"}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Prefill", "Decode", "Ready", "Age"]


def _walk(node: dict, path: str = ""):
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    schema = open_api_schema()
    for path, node in _walk(schema):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if "properties" in node:
            assert "additionalProperties" not in node, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(bound, True) is True, path


def test_cel_rules_are_in_the_crd_and_mirrored():
    emitted = [rule["rule"] for _, node in _walk(open_api_schema())
               for rule in node.get("x-kubernetes-validations", [])]
    declared = [r.rule for m in (models.ModelSource, models.PoolBounds,
                                 models.ServiceLevelObjectives, models.PDDeploymentSpec)
                for r in rules_of(m)]
    for rule in declared:
        assert rule in emitted
    joined = " ".join(emitted)
    assert "self.min <= self.max" in joined  # min <= max
    assert "self.prefill.replicas >= self.autoscaling.prefill.min" in joined  # within bounds
    assert "self.ttftSeconds > 0.0" in joined and "self.tpotSeconds > 0.0" in joined


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_valid_samples_pass(path):
    document = _load(path)
    assert _schema_errors(document) == []
    assert _cel_errors(document) == []


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_samples_are_rejected(path):
    document = _load(path)
    assert _schema_errors(document) + _cel_errors(document), f"{path.name} was accepted"


def test_each_invalid_sample_fails_for_its_reason():
    by_name = {p.stem: _load(p) for p in INVALID}
    assert any("minimum" in e for e in _schema_errors(by_name["negative-replicas"]))
    assert any("nccl" in e for e in _schema_errors(by_name["unsupported-transport"]))
    # Cross-field rules are CEL: the structural schema alone accepts them.
    assert _schema_errors(by_name["min-above-max"]) == []
    assert _cel_errors(by_name["min-above-max"]) == [
        "spec.autoscaling.decode.min: min must not exceed max"]
    assert _schema_errors(by_name["replicas-outside-bounds"]) == []
    assert _cel_errors(by_name["replicas-outside-bounds"]) == [
        "spec.prefill.replicas: prefill.replicas must lie within autoscaling.prefill bounds"]
    assert _schema_errors(by_name["zero-slo"]) and _cel_errors(by_name["zero-slo"])


@pytest.mark.parametrize("spec, field", [
    ({"prefill": {"replicas": -1}}, "spec.prefill.replicas"),
    ({"autoscaling": {"prefill": {"min": 3, "max": 1}}}, "spec.autoscaling.prefill.min"),
    ({"engine": {"blockSize": "big"}}, "spec.engine.blockSize"),
    ({"model": {"source": "pvc", "path": "x"}}, "spec.model.claimName"),
    ({"colour": "blue"}, "spec.colour"),
])
def test_spec_problems_name_the_field(spec, field):
    with pytest.raises(SpecProblem) as caught:
        parse_spec({"image": "worker:1", **spec})
    assert field in caught.value.fields


def test_defaults_round_trip():
    spec = parse_spec({"image": "worker:1"})
    assert (spec.prefill.replicas, spec.decode.replicas, spec.router.replicas) == (1, 1, 1)
    assert spec.model.source == "bundled" and spec.engine.block_size == 16
    dumped = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert dumped["kvTransfer"]["transport"] == "tcp"
    assert _schema_errors({"spec": dumped}) == []
