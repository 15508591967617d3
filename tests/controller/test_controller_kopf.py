"""The autoscaler daemon inside the real kopf operator, against kmock's Kubernetes emulator.

Each worker pod gets its own loopback address (127.0.0.2-4) on one port, where a fake worker
serves contract metrics of a long-prompt load and the drain/role endpoints. The daemon
scrapes them, decides to convert a decode worker to prefill, writes that to status.target
(the spec stays as the user wrote it); the operator then drains and converts that pod
through the same fake worker.
"""

from __future__ import annotations

import re
from typing import Any

import kopf
import pytest
from fleet_harness import FakeWorker, FleetDriver, Traffic
from operator_harness import NAMESPACE, api, eventually, running_operator

from baton.api.models import SizingDecision
from baton.operator.config import OperatorConfig

pytestmark = pytest.mark.asyncio
NAME = "auto"
PDD = f"/apis/baton.dev/v1alpha1/namespaces/{NAMESPACE}/pddeployments"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
LONG_PROMPTS = Traffic(arrival_rate=10, input_len=2000, output_len=20, prefill_supply=15_000)


def objects(emulator: Any, resource: str) -> dict[str, dict[str, Any]]:
    return {key[2]: obj.raw for key, obj in emulator.objects.items()
            if key[0] == resource and not obj.deleted}


def pods_by_role(emulator: Any, role: str) -> list[str]:
    return sorted(n for n, p in objects(emulator, "v1/pods").items()
                  if p["metadata"]["labels"]["baton.dev/role"] == role)


def deployment(emulator: Any) -> dict[str, Any]:
    return objects(emulator, "baton.dev/v1alpha1/pddeployments").get(NAME) or {}


def decisions_written(emulator: Any) -> list[dict[str, Any]]:
    return [r.data["status"]["lastDecision"] for r in list(emulator)
            if r.method == "PATCH" and str(r.url.path).endswith(f"/{NAME}/status")
            and isinstance(r.data, dict) and "lastDecision" in r.data.get("status", {})]


def events(emulator: Any, reason: str) -> list[str]:
    return [r.data.get("message", "") for r in list(emulator)
            if r.method == "POST" and str(r.url.path).endswith("/events")
            and r.data.get("reason") == reason]


async def start_workers() -> list[FakeWorker]:
    workers = [FakeWorker("prefill", "127.0.0.2"), FakeWorker("decode", "127.0.0.3"),
               FakeWorker("decode", "127.0.0.4")]
    await workers[0].start()
    for worker in workers[1:]:
        await worker.start(workers[0].port)  # one port, as in a cluster: pods differ by IP
    return workers


async def serve_pod(emulator: Any, name: str, ip: str) -> None:
    status = {"phase": "Running", "podIP": ip,
              "conditions": [{"type": "Ready", "status": "True"}]}
    await api(emulator, "PATCH", f"{PODS}/{name}/status", {"status": status})


async def test_long_prompts_convert_a_decode_pod_to_prefill(emulator):
    workers = await start_workers()
    config = OperatorConfig(
        connection=kopf.ConnectionInfo(server=str(emulator.url).rstrip("/")),
        worker_port=workers[0].port, worker_timeout=2.0, resync_seconds=1.0,
        busy_seconds=0.2, request_timeout=5.0, watch_timeout=30)
    driver = FleetDriver(workers, LONG_PROMPTS)
    driver.start()
    body = {
        "apiVersion": "baton.dev/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "generation": 1,
                     "uid": "0f1e2d3c-aaaa-bbbb-cccc-000000000006", "resourceVersion": "1"},
        "spec": {"image": "baton-worker:test", "prefill": {"replicas": 1},
                 "decode": {"replicas": 2},
                 "autoscaling": {"enabled": True, "periodSeconds": 1, "cooldownSeconds": 0,
                                 "prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 2},
                                 "slo": {"ttftSeconds": 1.0, "tpotSeconds": 0.1}}},
    }
    try:
        async with running_operator(config):
            await api(emulator, "POST", PDD, body)
            await eventually(lambda: len(objects(emulator, "v1/pods")) == 3, what="3 pods")
            [prefill_pod] = pods_by_role(emulator, "prefill")
            decode_pods = pods_by_role(emulator, "decode")
            await serve_pod(emulator, prefill_pod, workers[0].host)
            for name, worker in zip(decode_pods, workers[1:]):
                await serve_pod(emulator, name, worker.host)

            target = await eventually(lambda: deployment(emulator).get("status", {}).get("target"),
                                      timeout=30, what="the controller's target in status")
            [conversion] = target["conversions"]
            assert conversion["toRole"] == "prefill" and conversion["pod"] in decode_pods
            assert (target["prefill"], target["decode"]) == (2, 1)
            assert deployment(emulator)["spec"] == body["spec"]  # the user's spec, untouched

            # The operator carries it out through the pod's own worker endpoints.
            await eventually(lambda: conversion["pod"] in pods_by_role(emulator, "prefill"),
                             timeout=20, what="the pod relabelled prefill")
            converted = workers[1 + decode_pods.index(conversion["pod"])]
            assert converted.metrics.role == "prefill"
            assert [p for _, p, _ in converted.calls][0] == "/internal/drain"
            # Steady again at 2P1D: the loop holds and says so.
            await eventually(lambda: deployment(emulator).get("status", {})
                             .get("lastDecision", {}).get("reason", "").startswith("hold 2P1D"),
                             timeout=10, what="a hold at 2P1D")
    finally:
        await driver.stop()
        for worker in workers:
            await worker.stop()

    written = decisions_written(emulator)
    action = next(d for d in written if d["action"] == "convert-decode-to-prefill")
    model = SizingDecision.model_validate(action)
    assert "convert one decode worker to prefill (1P2D -> 2P1D)" in model.reason
    assert re.search(r"prefill at 1\.[2-4]\d", model.reason)  # the overloaded pool, named
    assert "arrival_rate=" in model.reason and "input_len=" in model.reason
    assert model.inputs["arrival_rate"] == pytest.approx(10, rel=0.3)
    assert model.inputs["input_len"] == pytest.approx(2000, rel=0.3)
    assert model.outputs["desired_prefill_workers"] == 2
    assert any("convert one decode worker to prefill" in m for m in events(emulator, "SizingDecision"))
    final = deployment(emulator)["status"]["lastDecision"]
    SizingDecision.model_validate(final)
    assert final["action"] == "hold"
