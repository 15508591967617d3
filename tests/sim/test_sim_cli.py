"""`baton plan` and `baton simulate` through the CLI dispatcher."""

import json

import pytest

from baton.cli import main


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_plan_json_shows_formulas_and_transfer_table(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--gpu", "h100", "--link-gbps", "800", "--rate", "4",
                 "--input-len", "8192", "--output-len", "256", "--ttft-slo", "2", "--tpot-slo", "0.05",
                 "--hit-rate", "0.2", "--workers", "16", "--json"]) == 0
    plan = _json(capsys)
    assert plan["kv_bytes_per_token"]["output"] == 327_680
    x, y = plan["workers"]["prefill"], plan["workers"]["decode"]
    assert plan["recommended"] == f"{x}P{y}D" and x >= 1 and y >= 1
    assert plan["prefill"]["demand_tokens_per_s"] == pytest.approx(4 * 0.8 * 8192)
    assert plan["transfer"]["bytes"] == pytest.approx(2.5 * 2**30)
    assert plan["transfer"]["exposed_s"] == pytest.approx(plan["transfer"]["transfer_s"] / 80)
    assert plan["fixed_fleet"]["split"].endswith("D")
    row = next(r for r in plan["kv_transfer_table"] if r["context_tokens"] == 16000 and r["link_gbps"] == 800)
    assert row["transfer_s"] == pytest.approx(0.0524, abs=1e-3)
    slow = next(r for r in plan["kv_transfer_table"] if r["context_tokens"] == 16000 and r["link_gbps"] == 200)
    assert slow["transfer_s"] == pytest.approx(0.21, abs=2e-3) and not slow["feasible"]


def test_plan_text_names_each_formula(capsys):
    assert main(["plan", "--model", "smollm2-135m", "--gpu", "a100", "--link-gbps", "100", "--rate", "5",
                 "--input-len", "2000", "--output-len", "200", "--ttft-slo", "1", "--tpot-slo", "0.05"]) == 0
    text = capsys.readouterr().out
    for phrase in ("recommended:", "kv bytes/token", "prefill demand", "M/D/1", "concurrency",
                   "disaggregation threshold", "exposed", "feasible"):
        assert phrase in text


def test_simulate_json_small(capsys, tmp_path):
    plot = tmp_path / "sim.png"
    assert main(["simulate", "--workers", "6", "--hours", "1", "--json", "--plot", str(plot)]) == 0
    report = _json(capsys)
    assert set(report["strategies"]) == {"controller", "best_static", "hourly_oracle"}
    assert {"goodput_rps", "slo_attainment", "conversions"} <= set(report["strategies"]["controller"])
    assert plot.stat().st_size > 10_000


def test_plan_day_for_a_fleet_size(capsys):
    assert main(["plan", "--day", "--workers", "200", "--model", "llama-3-8b", "--utilisation", "0.85",
                 "--ttft-slo", "1", "--json"]) == 0
    plan = _json(capsys)
    low, high = plan["split"]["prefill_range"]
    assert 1 <= low < high <= 199 and plan["split"]["decode_range"] == [200 - high, 200 - low]
    conversions, budget = plan["conversions"], plan["disruption_budget"]
    # Following the drift takes at least the distance the best split travels each way.
    assert conversions["per_day"] >= 2 * (high - low) - 2
    assert conversions["peak_per_hour"] == max(conversions["per_hour"]) > 0
    assert budget["needed_in_flight"] == max(budget["steady_in_flight"], budget["batch_at_margin"])
    assert budget["smallest_pool"] == min(low, 200 - high)
    assert budget["policy_limit"] == max(1, int(0.05 * budget["smallest_pool"]))
    assert budget["pdb_max_unavailable"] == "5%" and budget["pdb_pods"] == 10
    assert budget["fits"]


def test_plan_needs_a_workload_or_a_day():
    with pytest.raises(SystemExit, match="--rate"):
        main(["plan", "--input-len", "100"])
