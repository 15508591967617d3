"""The real kopf operator against kmock's KubernetesEmulator, and a loopback fake worker."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from typing import Any

import pytest
from operator_harness import NAMESPACE, SERVICE_MONITORS, api, declare, eventually, running_operator

pytestmark = pytest.mark.asyncio
NAME = "demo"
UID = "0f1e2d3c-aaaa-bbbb-cccc-000000000001"
PDD = f"/apis/baton.dev/v1alpha1/namespaces/{NAMESPACE}/pddeployments"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"


def pdd_body(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "baton.dev/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "uid": UID, "generation": 1,
                     "resourceVersion": "1"},  # kopf sends it back in a JSON-patch test
        "spec": {"image": "baton-worker:test", **spec},
    }


def objects(emulator: Any, resource: str) -> dict[str, dict[str, Any]]:
    return {key[2]: obj.raw for key, obj in emulator.objects.items()
            if key[0] == resource and not obj.deleted}


def pods(emulator: Any, role: str | None = None) -> dict[str, dict[str, Any]]:
    found = objects(emulator, "v1/pods")
    if role:
        found = {n: p for n, p in found.items() if p["metadata"]["labels"]["baton.dev/role"] == role}
    return found


def pdd_status(emulator: Any) -> dict[str, Any]:
    found = objects(emulator, "baton.dev/v1alpha1/pddeployments").get(NAME)
    return (found or {}).get("status") or {}


def status_writes(emulator: Any) -> int:
    return sum(1 for r in list(emulator)
               if r.method == "PATCH" and str(r.url.path) == f"{PDD}/{NAME}/status")


def events_posted(emulator: Any) -> list[Any]:
    return [r for r in list(emulator)
            if r.method == "POST" and str(r.url.path).endswith("/events")]


def condition(emulator: Any, kind: str) -> dict[str, Any]:
    return next((c for c in pdd_status(emulator).get("conditions", []) if c["type"] == kind), {})


async def make_ready(emulator: Any, name: str, ready: bool = True, ip: str = "127.0.0.1") -> None:
    status = {"phase": "Running", "podIP": ip,
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    await api(emulator, "PATCH", f"{PODS}/{name}/status", {"status": status})


async def make_all_ready(emulator: Any, ips: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, str]:
    """Every pod Running and Ready, addresses dealt from `ips` in name order; -> pod: IP."""
    given = {}
    for index, name in enumerate(sorted(pods(emulator))):
        given[name] = ips[index % len(ips)]
        await make_ready(emulator, name, ip=given[name])
    await api(emulator, "PATCH",
              f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{NAME}-router/status",
              {"status": {"readyReplicas": 1}})
    return given


async def patch_spec(emulator: Any, spec: dict[str, Any], generation: int) -> None:
    await api(emulator, "PATCH", f"{PDD}/{NAME}",
              {"metadata": {"generation": generation}, "spec": spec})


async def test_create_builds_children(emulator, operator_factory):
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body(prefill={"replicas": 2}, decode={"replicas": 1}))
        await eventually(lambda: len(pods(emulator)) == 3, what="3 worker pods")
        await eventually(lambda: condition(emulator, "Ready"), what="status written")

    assert len(pods(emulator, "prefill")) == 2 and len(pods(emulator, "decode")) == 1
    for pod in pods(emulator).values():
        meta = pod["metadata"]
        assert meta["ownerReferences"][0]["uid"] == UID
        assert meta["ownerReferences"][0]["controller"] is True
        assert meta["labels"]["app.kubernetes.io/name"] == "baton"
        assert meta["labels"]["app.kubernetes.io/instance"] == NAME
        assert meta["labels"]["app.kubernetes.io/component"] == "worker"
        assert meta["labels"]["baton.dev/deployment"] == NAME
        assert meta["labels"]["baton.dev/state"] == "active"
        role = meta["labels"]["baton.dev/role"]
        container = pod["spec"]["containers"][0]
        args = container["args"]
        assert args[:4] == ["baton", "worker", "--role", "$(BATON_ROLE)"]
        role_env = next(e for e in container["env"] if e["name"] == "BATON_ROLE")
        assert role_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['baton.dev/role']"
        assert role in ("prefill", "decode")
        assert args[args.index("--host") + 1] == "0.0.0.0"
        assert args[args.index("--port") + 1] == "8100"
        assert args[args.index("--kv-port") + 1] == "8101"
        assert args[args.index("--block-size") + 1] == "16"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        token = next(e for e in container["env"] if e["name"] == "BATON_INTERNAL_TOKEN")
        assert token["valueFrom"]["secretKeyRef"]["name"] == f"{NAME}-internal-token"

    services = objects(emulator, "v1/services")
    assert services[f"{NAME}-prefill"]["spec"]["clusterIP"] == "None"
    assert services[f"{NAME}-decode"]["spec"]["selector"]["baton.dev/role"] == "decode"
    assert services[NAME]["spec"]["ports"][0]["port"] == 8000
    router = objects(emulator, "apps/v1/deployments")[f"{NAME}-router"]
    assert router["metadata"]["ownerReferences"][0]["uid"] == UID
    assert router["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "baton", "router", "--host", "0.0.0.0", "--port", "8000", "--discovery", "kubernetes",
        "--deployment", NAME, "--model", "bundled", "--block-size", "16"]
    assert f"{NAME}-workers" in objects(emulator, "policy/v1/poddisruptionbudgets")
    policy = objects(emulator, "networking.k8s.io/v1/networkpolicies")[f"{NAME}-workers"]
    sources = [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
               for peer in policy["spec"]["ingress"][0]["from"]]
    assert sorted(sources) == ["router", "worker"]
    secret = objects(emulator, "v1/secrets")[f"{NAME}-internal-token"]
    assert len(base64.b64decode(secret["data"]["token"])) >= 32
    assert not objects(emulator, SERVICE_MONITORS)  # that CRD is not installed here
    owner = objects(emulator, "baton.dev/v1alpha1/pddeployments")[NAME]
    assert "baton.dev/operator" in owner["metadata"]["finalizers"]
    assert condition(emulator, "Ready")["status"] == "False"
    assert pdd_status(emulator)["prefill"].items() >= {"desired": 2, "current": 2, "ready": 0}.items()
    reasons = {r.data["reason"] for r in events_posted(emulator)}
    assert "Created" in reasons  # one Event per action, on the PDDeployment


async def test_service_monitor_when_its_crd_exists(emulator, operator_config):
    declare(emulator, SERVICE_MONITORS, "ServiceMonitor")
    # what kube-prometheus-stack's Prometheus selects ServiceMonitors by
    config = dataclasses.replace(operator_config, service_monitor_labels={"release": "kps"})
    async with running_operator(config):
        await api(emulator, "POST", PDD, pdd_body())
        monitor = await eventually(lambda: objects(emulator, SERVICE_MONITORS).get(NAME))
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["metadata"]["labels"]["baton.dev/deployment"] == NAME


async def test_status_follows_readiness(emulator, operator_factory):
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body(prefill={"replicas": 1}, decode={"replicas": 2}))
        await eventually(lambda: len(pods(emulator)) == 3)
        await make_all_ready(emulator)
        await eventually(lambda: condition(emulator, "Ready").get("status") == "True",
                         what="Ready=True")
        assert pdd_status(emulator)["decode"].items() >= {"desired": 2, "current": 2, "ready": 2}.items()
        assert condition(emulator, "Progressing")["status"] == "False"
        # Steady state: further resync passes (every second here) write no status.
        writes = status_writes(emulator)
        assert writes > 0
        await asyncio.sleep(2.5)
        assert status_writes(emulator) == writes
        first_transition = condition(emulator, "Ready")["lastTransitionTime"]

        await make_ready(emulator, next(iter(pods(emulator, "decode"))), ready=False)
        await eventually(lambda: condition(emulator, "Ready").get("status") == "False")
        assert pdd_status(emulator)["decode"]["ready"] == 1
        assert condition(emulator, "Ready")["lastTransitionTime"] >= first_transition


async def test_scale_up_then_down_drains_first(emulator, operator_factory, fake_worker):
    fake_worker.drain_finished = False
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body(prefill={"replicas": 2}, decode={"replicas": 1}))
        await eventually(lambda: len(pods(emulator)) == 3)
        await make_all_ready(emulator)

        await patch_spec(emulator, {"decode": {"replicas": 2}}, generation=2)
        await eventually(lambda: len(pods(emulator, "decode")) == 2, what="scale up")

        await patch_spec(emulator, {"prefill": {"replicas": 1}}, generation=3)
        draining = await eventually(lambda: [
            n for n, p in pods(emulator, "prefill").items()
            if p["metadata"]["labels"]["baton.dev/state"] == "draining"], what="a draining pod")
        await eventually(lambda: "/internal/drain" in fake_worker.paths("GET"), what="drain poll")
        assert len(pods(emulator, "prefill")) == 2  # not deleted while still draining
        assert fake_worker.paths("POST") == ["/internal/drain"]
        token = base64.b64decode(
            objects(emulator, "v1/secrets")[f"{NAME}-internal-token"]["data"]["token"]).decode()
        assert {auth for _, _, auth, _ in fake_worker.calls} == {f"Bearer {token}"}
        assert condition(emulator, "Scaling")["status"] == "True"

        fake_worker.drain_finished = True
        await eventually(lambda: len(pods(emulator, "prefill")) == 1, what="drained pod deleted")
        assert draining[0] not in pods(emulator)
        await eventually(lambda: pdd_status(emulator).get("observedGeneration") == 3)


async def test_pod_deleted_by_hand_is_recreated(emulator, operator_factory):
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body())
        await eventually(lambda: len(pods(emulator)) == 2)
        victim = next(iter(pods(emulator, "decode")))
        await api(emulator, "DELETE", f"{PODS}/{victim}")
        await eventually(lambda: len(pods(emulator, "decode")) == 1 and victim not in pods(emulator),
                         what="replacement pod")


async def test_deleting_the_deployment_removes_children(emulator, operator_factory):
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body())
        await eventually(lambda: len(pods(emulator)) == 2 and objects(emulator, "v1/services"))
        await eventually(lambda: objects(emulator, "apps/v1/deployments"))
        await api(emulator, "DELETE", f"{PDD}/{NAME}")
        await eventually(lambda: not objects(emulator, "baton.dev/v1alpha1/pddeployments"),
                         what="finalizer released")
    for resource in ("v1/pods", "v1/services", "apps/v1/deployments", "v1/secrets",
                     "policy/v1/poddisruptionbudgets", "networking.k8s.io/v1/networkpolicies"):
        assert not objects(emulator, resource), resource


async def test_bad_spec_sets_degraded_and_recovers(emulator, operator_factory):
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body(
            autoscaling={"enabled": True, "prefill": {"min": 3, "max": 1}}))
        degraded = await eventually(lambda: condition(emulator, "Degraded").get("status") == "True"
                                    and condition(emulator, "Degraded"))
        assert degraded["reason"] == "InvalidSpec"
        assert "spec.autoscaling.prefill.min" in degraded["message"]
        assert not pods(emulator)

        await patch_spec(emulator, {"autoscaling": {"prefill": {"min": 1, "max": 3}}}, generation=2)
        await eventually(lambda: condition(emulator, "Degraded").get("status") == "False")
        await eventually(lambda: len(pods(emulator)) == 2, what="pods after the fix")


async def test_a_host_path_model_is_refused_unless_allowed(emulator, operator_factory):
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body(model={"source": "hostPath", "path": "/etc"}))
        degraded = await eventually(lambda: condition(emulator, "Degraded").get("status") == "True"
                                    and condition(emulator, "Degraded"))
        assert degraded["reason"] == "InvalidSpec"
        assert "spec.model.path" in degraded["message"] and "--allow-host-path" in degraded["message"]
        assert not pods(emulator)


AUTOSCALED = {"autoscaling": {"enabled": True, "prefill": {"min": 1, "max": 2},
                              "decode": {"min": 1, "max": 2}}}


async def test_conversion_survives_operator_restart_and_a_reapplied_spec(
        emulator, operator_factory, fake_worker):
    fake_worker.drain_finished = False
    # pools of different sizes: the converted worker regroups onto the decode pool's one rank
    per_rank = {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"nvidia.com/gpu": 1}}
    as_in_git = {"prefill": {"replicas": 2, "tensorParallelSize": 2, "resources": per_rank},
                 "decode": {"replicas": 1, "resources": per_rank}, **AUTOSCALED}
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body(**as_in_git))
        await eventually(lambda: len(pods(emulator)) == 3)
        # resources are per rank; with conversions possible every pod holds the larger pool's 2
        for body in pods(emulator).values():
            assert body["spec"]["containers"][0]["resources"] == {
                "requests": {"cpu": "1000m", "memory": "4Gi"}, "limits": {"nvidia.com/gpu": "2"}}
        created = set(pods(emulator))
        await make_all_ready(emulator)
        await eventually(lambda: condition(emulator, "Ready").get("status") == "True")
        chosen = sorted(pods(emulator, "prefill"))[0]
        # the controller's decision: status.target, in one patch with the new sizes
        await api(emulator, "PATCH", f"{PDD}/{NAME}/status", {"status": {"target": {
            "prefill": 1, "decode": 2, "conversions": [{"pod": chosen, "toRole": "decode"}]}}})
        await eventually(lambda: pods(emulator)[chosen]["metadata"]["labels"]["baton.dev/state"]
                         == "draining", what="conversion started")
        in_flight = await eventually(lambda: pdd_status(emulator).get("conversions"))
        assert in_flight[0]["pod"] == chosen and in_flight[0]["toRole"] == "decode"
        assert in_flight[0]["phase"] == "Draining"
        # a GitOps tool applies the spec as committed: nothing of the conversion is in it
        await patch_spec(emulator, as_in_git, generation=2)
    # The operator is gone half-way; the worker finishes draining meanwhile.
    assert "/internal/role" not in fake_worker.paths("POST")
    fake_worker.drain_finished = True

    async with operator_factory():
        await eventually(lambda: pods(emulator)[chosen]["metadata"]["labels"]["baton.dev/role"]
                         == "decode", what="relabelled to decode")
        await eventually(lambda: pdd_status(emulator).get("conversions") == [])
        await eventually(lambda: pdd_status(emulator).get("observedGeneration") == 2)
    labels = pods(emulator)[chosen]["metadata"]["labels"]
    assert labels["baton.dev/state"] == "active"
    assert labels["baton.dev/tensor-parallel-size"] == "1"  # a restart comes back at that size
    assert fake_worker.role == "decode"
    assert fake_worker.paths("POST") == ["/internal/drain", "/internal/role"]
    role_body = [body for method, path, _, body in fake_worker.calls if path == "/internal/role"]
    assert role_body == [{"role": "decode", "tensor_parallel_size": 1}]
    assert len(pods(emulator)) == 3  # converted in place: nothing created or deleted
    assert set(pods(emulator)) == created  # the same pods: none rolled or replaced
    assert len(pods(emulator, "decode")) == 2  # the controller's split holds, the spec's 2P1D not
    assert pdd_status(emulator)["decode"]["desired"] == 2
