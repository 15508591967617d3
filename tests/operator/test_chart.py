"""The Helm chart passes a real Helm lint (Helm's Go library through helm-sdkpy).

helm-sdkpy needs Python >= 3.12, so the test builds its own venv (git-ignored .venv-helm/)
and runs the lint there, on the chart with default values and with every feature on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "baton"
HELM_VENV = ROOT / ".venv-helm"
PYTHON312 = Path("/root/.pyenv/versions/3.12.1/bin/python")
SEVERITY_WARNING = 2  # Helm's support.WarningSev; INFO (1) notes such as a missing icon pass

LINT = """
import asyncio, json, sys
import helm_sdkpy

async def main():
    config = helm_sdkpy.Configuration(namespace="baton-system")
    print(json.dumps(await helm_sdkpy.Lint(config).run(sys.argv[1])))

asyncio.run(main())
"""

ALL_FEATURES = {
    "image": {"repository": "registry.example/baton-operator", "tag": "0.1.0",
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccount": {"create": True, "name": "baton", "annotations": {"team": "ml"}},
    "operator": {"watchNamespaces": ["serving", "staging"], "resyncSeconds": 15,
                 "metricsNamespace": "monitoring", "verbose": True},
    "podAnnotations": {"example.com/scrape": "true"},
    "podLabels": {"team": "ml"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {}},
    "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
    "dashboards": {"enabled": True, "labels": {"team": "ml"},
                   "annotations": {"grafana_folder": "Baton"}},
}


@pytest.fixture(scope="module")
def helm_python() -> Path:
    python = HELM_VENV / "bin" / "python"
    probe = [str(python), "-c", "import helm_sdkpy"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    if not PYTHON312.exists():
        pytest.skip("Python 3.12 (needed by helm-sdkpy) is not installed")
    subprocess.run([str(PYTHON312), "-m", "venv", str(HELM_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "helm-sdkpy"], check=True)
    return python


def lint(helm_python: Path, chart: Path) -> dict:
    done = subprocess.run([str(helm_python), "-c", LINT, str(chart)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def assert_clean(result: dict) -> None:
    assert result["TotalChartsLinted"] == 1
    assert not result["Errors"], result
    serious = [m for m in result["Messages"] if m["Severity"] >= SEVERITY_WARNING]
    assert not serious, serious  # helm-sdkpy keeps the path of a finding, not its text


def chart_copy(tmp_path: Path, values: dict | None = None, dashboards: bool = True) -> Path:
    copy = tmp_path / "baton"
    shutil.copytree(CHART, copy)
    if values is not None:
        merged = yaml.safe_load((CHART / "values.yaml").read_text())
        merged.update(values)
        (copy / "values.yaml").write_text(yaml.safe_dump(merged))
    if not dashboards:
        for path in (copy / "dashboards").glob("*.json"):
            path.unlink()
    return copy


@pytest.mark.slow
def test_chart_lints_with_default_values(helm_python):
    assert_clean(lint(helm_python, CHART))


@pytest.mark.slow
def test_chart_lints_with_every_feature_on(helm_python, tmp_path):
    assert_clean(lint(helm_python, chart_copy(tmp_path, ALL_FEATURES)))


@pytest.mark.slow
def test_chart_lints_with_dashboards_on_and_none_present(helm_python, tmp_path):
    assert_clean(lint(helm_python, chart_copy(tmp_path, {"dashboards": {"enabled": True}},
                                              dashboards=False)))


@pytest.mark.slow
def test_lint_catches_a_broken_chart(helm_python, tmp_path):
    broken = chart_copy(tmp_path, {"unknownKey": True})  # refused by values.schema.json
    assert lint(helm_python, broken)["Errors"]


def test_chart_carries_the_generated_crd():
    from baton.api.crdgen import FILE_NAME, render_crd

    assert (CHART / "crds" / FILE_NAME).read_text() == render_crd()


def test_values_schema_accepts_defaults_and_all_features():
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(defaults, schema)
    jsonschema.validate({**defaults, **ALL_FEATURES}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**defaults, "replicaCount": 2}, schema)  # one operator, always


def test_operator_deployment_template_pins_one_recreated_replica():
    text = (CHART / "templates" / "deployment.yaml").read_text()
    assert "replicas: 1" in text and "type: Recreate" in text and "livenessProbe" in text


def test_operator_pod_knows_its_namespace_and_passes_the_scrapers():
    text = (CHART / "templates" / "deployment.yaml").read_text()
    env = text[text.index("env:"):text.index("ports:")]
    assert "name: POD_NAMESPACE" in env and "fieldPath: metadata.namespace" in env
    assert "--metrics-pod-label={{ $key }}={{ $value }}" in text
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]
    assert defaults["metricsPodLabels"] == {"app.kubernetes.io/name": "prometheus"}
