"""The CRD's rules under real engines: its OpenAPI schema under jsonschema, its
x-kubernetes-validations under cel-python (a CEL implementation, not the models' Python
mirror), and the local cluster's API server refusing crds/samples/invalid/ as kubectl sends it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from e2e.apiserver import crvalidation

ROOT = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((ROOT / "crds" / "pddeployments.baton.dev.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
VALID = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
INVALID = sorted((ROOT / "crds" / "samples" / "invalid").glob("*.yaml"))


def test_every_rule_compiles_under_cel():
    assert crvalidation.compile_rules(SCHEMA) >= 5


@pytest.mark.parametrize("sample", VALID, ids=lambda p: p.name)
def test_the_samples_pass_schema_and_rules(sample):
    defaulted = crvalidation.validate(yaml.safe_load(sample.read_text()), SCHEMA)
    assert defaulted["spec"]["prefill"]["replicas"] >= 0  # defaults were applied


@pytest.mark.parametrize("sample", INVALID, ids=lambda p: p.name)
def test_the_invalid_samples_are_refused(sample):
    with pytest.raises(ValueError):
        crvalidation.validate(yaml.safe_load(sample.read_text()), SCHEMA)


def test_cel_sees_number_fields_as_doubles_and_refuses_what_the_rules_refuse():
    spec = {"image": "x", "autoscaling": {"enabled": True, "slo": {"ttftSeconds": 1}}}
    crvalidation.validate({"spec": spec}, SCHEMA)  # 1 (int in JSON) > 0.0: a double in CEL
    spec["autoscaling"]["decode"] = {"min": 3, "max": 2}
    with pytest.raises(ValueError, match="min must not exceed max"):
        crvalidation.validate({"spec": spec}, SCHEMA)
    with pytest.raises(ValueError, match="claimName is required"):
        crvalidation.validate({"spec": {"image": "x", "model": {"source": "pvc", "path": "m"}}},
                              SCHEMA)
    with pytest.raises(ValueError, match="Additional properties"):
        crvalidation.validate({"spec": {"image": "x", "imagee": "typo"}}, SCHEMA)


@pytest.mark.slow
def test_the_cluster_refuses_invalid_samples_and_accepts_the_others(cluster):
    for sample in INVALID:
        out = cluster.kubectl("apply", "-f", str(sample), check=False)
        assert "is invalid" in out, (sample.name, out)
    for sample in VALID:
        out = cluster.kubectl("apply", "--dry-run=server", "-f", str(sample), check=False)
        assert "(server dry run)" in out, (sample.name, out)
    assert "bad-bounds" not in cluster.kubectl("get", "pdd", "-A")
