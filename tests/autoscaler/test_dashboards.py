"""The Grafana dashboards parse, every query uses only metrics named in the contracts, and
every query is scoped to the one PDDeployment the dashboard's variables pick."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "charts" / "baton" / "dashboards").glob("*.json"))
CONTRACTS = (ROOT / "docs" / "contracts.md").read_text()

METRICS = set(re.findall(r"`(baton_[a-z0-9_]+)", CONTRACTS))
HISTOGRAMS = set(re.findall(r"`(baton_[a-z0-9_]+)` \| histogram", CONTRACTS))
SERIES = METRICS | {f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
LABELS = {"role", "pool", "action", "deployment", "direction", "kind", "le", "namespace", "pod"}
PROMQL_WORDS = {
    "sum", "avg", "max", "min", "count", "by", "without", "on", "ignoring", "group_left", "group_right",
    "rate", "irate", "increase", "histogram_quantile", "clamp_min", "clamp_max", "and", "or", "unless",
}
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
VARIABLES = {"$namespace", "$deployment"}
# Worker series are picked by the pod's namespace and name (NAME-w-xxxxxx), as the Prometheus
# Operator labels scraped pods; the controller's own series carry the deployment's name.
WORKER_SCOPE = ('namespace="$namespace"', 'pod=~"$deployment-w-.+"')
CONTROLLER_SCOPE = ('deployment="$deployment"',)
SELECTOR = re.compile(r"(baton_[a-z0-9_]+)(?:\{([^}]*)\})?")


def substitute(expr: str, namespace: str, deployment: str) -> str:
    """The query Grafana sends once the variables are chosen."""
    return expr.replace("$namespace", namespace).replace("$deployment", deployment)


def _exprs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr":
                yield value
            else:
                yield from _exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def _balanced(expr: str) -> bool:
    pairs, stack, quoted = {")": "(", "]": "[", "}": "{"}, [], False
    for ch in expr:
        if ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and not quoted


def test_contracts_list_the_metrics():
    assert "baton_time_to_first_token_seconds" in HISTOGRAMS
    assert "baton_autoscaler_desired_workers" in METRICS


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_use_contract_metrics(path):
    dashboard = json.loads(path.read_text())
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    assert any(v["name"] == "DS_PROMETHEUS" and v["type"] == "datasource" for v in dashboard["templating"]["list"])
    exprs = list(_exprs(dashboard))
    assert len(exprs) >= 8
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["namespace"]["type"] == variables["deployment"]["type"] == "query"
    assert re.fullmatch(variables["deployment"]["regex"].strip("/"), "chat-w-1a2b3c").group(1) == "chat"
    for expr in exprs:
        assert _balanced(expr), expr
        assert set(re.findall(r"\$\w+", expr)) <= VARIABLES, expr
        for metric, matchers in SELECTOR.findall(expr):
            wanted = CONTROLLER_SCOPE if metric.startswith("baton_autoscaler_") else WORKER_SCOPE
            assert all(m in matchers for m in wanted), f"{metric} not scoped in {path.name}: {expr}"
        bare = re.sub(r'"[^"]*"', "", expr)
        bare = re.sub(r"\[\d+[smhd]\]", "", bare)  # range selectors
        for name in IDENTIFIER.findall(bare):
            if name.startswith("baton_"):
                assert name in SERIES, f"{name} is not in docs/contracts.md ({path.name}: {expr})"
            else:
                assert name in PROMQL_WORDS | LABELS, f"unexpected identifier {name!r} in {expr}"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"


def test_both_dashboards_exist_and_cover_the_brief():
    names = {p.name for p in DASHBOARDS}
    assert {"serving.json", "controller.json"} <= names
    serving = " ".join(_exprs(json.loads((ROOT / "charts/baton/dashboards/serving.json").read_text())))
    for metric in ("baton_time_to_first_token_seconds_bucket", "baton_inter_token_latency_seconds_bucket",
                   "baton_e2e_request_latency_seconds_bucket", "baton_kv_cache_usage_ratio",
                   "baton_num_requests_waiting", "baton_kv_transfer_bytes_total",
                   "baton_kv_exposed_transfer_seconds_bucket", "baton_step_seconds_bucket",
                   "baton_step_prompt_tokens_sum", "baton_step_off_cpu_seconds_sum"):
        assert metric in serving
    controller = " ".join(_exprs(json.loads((ROOT / "charts/baton/dashboards/controller.json").read_text())))
    for metric in ("baton_autoscaler_desired_workers", "baton_autoscaler_actual_workers",
                   "baton_autoscaler_arrival_rate", "baton_autoscaler_decisions_total",
                   "baton_role_conversions_total", "baton_autoscaler_prefix_hit_rate"):
        assert metric in controller
