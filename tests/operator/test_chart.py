"""The Helm chart passes a real Helm lint (Helm's Go library through helm-sdkpy).

helm-sdkpy needs Python >= 3.12, so the test builds its own venv (git-ignored .venv-helm/)
and runs the lint there, on the chart with default values and with every feature on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from baton.api import parse_spec

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
                 "metricsNamespace": "monitoring", "verbose": True,
                 "metricsPodLabels": {"app.kubernetes.io/name": "prometheus"},
                 "serviceMonitorLabels": {"release": "kube-prometheus-stack"},
                 "allowedHostPaths": ["/srv/models"]},
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


def test_the_operator_flags_the_chart_passes_exist():
    """Each --flag=... in the chart's operator args is one `baton operator` accepts."""
    import argparse
    import re

    from baton.operator import main as operator_main

    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    known = {option for action in parser._actions for option in action.option_strings}
    text = (CHART / "templates" / "deployment.yaml").read_text()
    used = set(re.findall(r"^\s*- (--[a-z-]+)", text, flags=re.MULTILINE))
    assert {"--service-monitor-label", "--metrics-pod-label", "--namespace"} <= used
    assert used <= known, used - known


def test_secrets_are_read_cluster_wide_only_when_every_namespace_is_watched():
    """With operator.watchNamespaces set, namespaced grants (Secrets among them) come from a
    Role in each watched namespace; the ClusterRole keeps only cluster-scoped reads."""
    templates = CHART / "templates"
    helpers = (templates / "_helpers.tpl").read_text()
    start = helpers.index('{{- define "baton.namespacedRules" -}}')
    namespaced = helpers[start:helpers.index("{{- end }}", start)]
    assert '"secrets"' in namespaced and '"pods"' in namespaced and '"pddeployments"' in namespaced
    cluster = (templates / "clusterrole.yaml").read_text()
    assert '"secrets"' not in cluster and '"pods"' not in cluster
    guarded = cluster[cluster.index("{{- if not .Values.operator.watchNamespaces }}"):]
    assert 'include "baton.namespacedRules"' in guarded.split("{{- end }}")[0]
    role = (templates / "role.yaml").read_text()
    assert "range .Values.operator.watchNamespaces" in role
    assert "kind: Role\n" in role and "kind: RoleBinding" in role
    assert 'include "baton.namespacedRules" $' in role


def test_uninstall_runs_a_pre_delete_hook_that_removes_the_deployments_first():
    from baton.cli import COMMANDS
    from baton.operator import uninstall

    hook = (CHART / "templates" / "uninstall-hook.yaml").read_text()
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert "helm.sh/hook: pre-delete" in helpers and 'include "baton.uninstallHook"' in hook
    assert "- remove-deployments" in hook and COMMANDS["remove-deployments"][0] == uninstall.__name__
    assert '"delete"' in hook and "kind: Job" in hook
    assert yaml.safe_load((CHART / "values.yaml").read_text())["uninstall"]["removeDeployments"]


def test_notes_point_only_at_files_the_chart_or_the_repository_holds():
    """NOTES.txt is what a user reads after `helm install`: every `-f PATH` it gives must exist
    (in the chart, or in the repository the chart is installed from), or be `-` (stdin)."""
    import re

    notes = (CHART / "templates" / "NOTES.txt").read_text()
    paths = re.findall(r"\s-f\s+(\S+)", notes)
    assert paths
    for path in paths:
        assert path == "-" or (CHART / path).exists() or (ROOT / path).exists(), path
        if path != "-":
            assert path.startswith("charts/baton/") or (CHART / path).exists(), path
    # the inline sample is a valid PDDeployment
    sample = textwrap.dedent(notes[notes.index("  apiVersion: baton.dev"):notes.index("  EOF")])
    body = yaml.safe_load(sample.replace("{{ .Chart.AppVersion }}", "0.1.0"))
    assert body["kind"] == "PDDeployment"
    parse_spec(body["spec"])
