"""`baton up --autoscale`: its options, and the controller's /decisions and /metrics server."""

from __future__ import annotations

import argparse

import httpx
import pytest
from prometheus_client import CollectorRegistry

from baton.autoscaler.inputs import Action, Decision, PolicyConfig
from baton.autoscaler.instruments import metrics_for
from baton.autoscaler.loop import decision_record
from baton.local.controller_http import ControllerServer, DecisionLog, decision_line
from baton.local.supervisor import Liveness
from baton.local.up import add_arguments, autoscale_settings, spec_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--autoscale", *argv])


def test_autoscale_options_reach_the_policy():
    defaults = autoscale_settings(parse())
    assert defaults.period_s == 15.0 and defaults.window_s is None and defaults.port == 0
    assert defaults.policy == PolicyConfig()
    chosen = autoscale_settings(parse("--autoscale-period", "5", "--autoscale-window", "15",
                                      "--autoscale-persist", "2", "--autoscale-cooldown", "10",
                                      "--slo", "ttft=20s,tpot=1s", "--controller-port", "9123"))
    assert (chosen.period_s, chosen.window_s, chosen.port) == (5.0, 15.0, 9123)
    assert chosen.policy == PolicyConfig(ttft_slo_s=20.0, tpot_slo_s=1.0, persist_periods=2, cooldown_s=10.0)
    for bad in (["--autoscale-period", "0"], ["--autoscale-window", "0"], ["--autoscale-persist", "0"],
                ["--slo", "speed=1s"]):
        with pytest.raises(ValueError):
            autoscale_settings(parse(*bad))


def test_workers_keep_decodes_within_the_tpot_the_sizing_plans_for():
    assert spec_from_args(parse("--slo", "ttft=2s,tpot=80ms")).worker_args == ["--tpot-objective-ms", "80"]
    planned = spec_from_args(parse()).worker_args  # --autoscale without --slo: the policy's default
    assert planned == ["--tpot-objective-ms", f"{PolicyConfig.tpot_slo_s * 1e3:g}"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert spec_from_args(parser.parse_args(["--worker-arg=--dtype=float32"])).worker_args == ["--dtype=float32"]


def test_decisions_and_metrics_over_http():
    import datetime as dt

    registry = CollectorRegistry()
    metrics = metrics_for(registry)
    metrics.start("local")
    log = DecisionLog(period_s=5.0, keep=2)
    decision = Decision(Action.CONVERT_DECODE_TO_PREFILL, (1, 2), (2, 1), (2, 1),
                        "convert one decode worker to prefill (1P2D -> 2P1D); inputs input_len=1.2e+03",
                        {"input_len": 1200.0, "arrival_rate": None}, {"gain": 0.5})
    status = decision_record(decision, dt.datetime(2025, 1, 1, tzinfo=dt.UTC), "converting w1")
    for _ in range(3):
        record = log.add(decision, status, "converting w1", None)
    assert "period 3: convert-decode-to-prefill: convert one" in decision_line(record)
    assert decision_line(record).endswith("[converting w1]")
    server = ControllerServer(log, registry).start()
    try:
        body = httpx.get(f"{server.url}/decisions").json()
        text = httpx.get(f"{server.url}/metrics").text
        missing = httpx.get(f"{server.url}/nothing")
    finally:
        server.stop()
    assert body["period_s"] == 5.0 and body["periods"] == 3
    assert [d["period"] for d in body["decisions"]] == [2, 3]  # only the last `keep`
    last = body["decisions"][-1]
    assert last["action"] == "convert-decode-to-prefill" and last["applied"] == "converting w1"
    assert last["inputs"] == {"input_len": 1200.0} and last["current"] == [1, 2]
    assert last["explanation"].startswith("convert one decode worker")
    assert 'baton_autoscaler_decisions_total{action="hold",deployment="local"} 0.0' in text
    assert missing.status_code == 404


def test_liveness_probe_settings_reach_the_stack_and_bad_ones_name_the_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert spec_from_args(parser.parse_args([])).liveness == Liveness()
    spec = spec_from_args(parser.parse_args(["--liveness-period", "1", "--liveness-failures", "2"]))
    assert spec.liveness == Liveness(period_s=1.0, timeout_s=1.0, failures=2)
    for bad in (["--liveness-period", "0"], ["--liveness-failures", "0"]):
        with pytest.raises(ValueError, match="--liveness-period must be positive"):
            spec_from_args(parser.parse_args(bad))
