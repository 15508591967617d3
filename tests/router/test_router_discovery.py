"""Kubernetes discovery against kmock's KubernetesEmulator: pods come, go ready, drain, leave."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from baton.router.discovery import KubernetesDiscovery, member_from_pod
from baton.router.pool import WorkerPool
from baton.router.worker_client import WorkerClient

NAMESPACE = "default"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


def pod(name: str, role: str, deployment: str = "demo", state: str = "active") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {
                "app.kubernetes.io/component": "worker", "baton.dev/deployment": deployment,
                "baton.dev/role": role, "baton.dev/state": state}},
            "spec": {"containers": [{"name": "worker", "image": "x"}]}}


def ready_status(ip: str, ready: bool = True) -> dict[str, Any]:
    return {"status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


async def call(emulator: Any, method: str, path: str, body: Any = None) -> None:
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
    async with emulator.request(method, path, data=None if body is None else json.dumps(body),
                                headers=headers) as response:
        assert response.status < 400, await response.text()


async def until(check, timeout_s: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (value := check()):
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return value


def test_member_from_pod_rules():
    p = {**pod("a", "prefill"), **ready_status("10.0.0.1")}
    assert member_from_pod(p, "demo", 8100).url == "http://10.0.0.1:8100"
    assert member_from_pod(p, "other", 8100) is None
    assert member_from_pod({**pod("a", "decode"), **ready_status("10.0.0.1", ready=False)}, "demo", 8100) is None
    gone = {**p, "metadata": {**p["metadata"], "deletionTimestamp": "2024-01-01T00:00:00Z"}}
    assert member_from_pod(gone, "demo", 8100) is None


@pytest.mark.asyncio
async def test_watch_follows_pods(kmock):
    kmock.resources["v1/pods"] = kmock.ResourceInfo(kind="Pod", singular="pod", namespaced=True,
                                                    verbs=VERBS, subresources={"status"})
    await call(kmock, "POST", PODS, pod("p0", "prefill"))
    client = WorkerClient()
    pool = WorkerPool(client)
    discovery = KubernetesDiscovery("demo", NAMESPACE, api_url=str(kmock.url).rstrip("/"),
                                    worker_port=8100, reconnect_s=0.1)
    task = asyncio.create_task(discovery.run(pool))
    members = lambda: {s.url: s for s in pool.snapshots()}
    try:
        await asyncio.sleep(0.3)
        assert members() == {}  # not ready yet
        await call(kmock, "PATCH", f"{PODS}/p0/status", ready_status("10.0.0.1"))
        await call(kmock, "POST", PODS, pod("d0", "decode"))
        await call(kmock, "PATCH", f"{PODS}/d0/status", ready_status("10.0.0.2"))
        await call(kmock, "POST", PODS, pod("x0", "decode", deployment="other"))
        await call(kmock, "PATCH", f"{PODS}/x0/status", ready_status("10.0.0.9"))
        await until(lambda: len(members()) == 2)
        assert members()["http://10.0.0.1:8100"].role == "prefill"
        assert members()["http://10.0.0.2:8100"].role == "decode"
        # the operator labels a worker draining: it keeps its membership but takes no work
        await call(kmock, "PATCH", f"{PODS}/d0", {"metadata": {"labels": {"baton.dev/state": "draining"}}})
        await until(lambda: members()["http://10.0.0.2:8100"].state == "draining")
        await call(kmock, "DELETE", f"{PODS}/d0")
        await until(lambda: "http://10.0.0.2:8100" not in members())
        assert list(members()) == ["http://10.0.0.1:8100"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
