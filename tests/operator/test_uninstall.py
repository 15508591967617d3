"""`helm uninstall`'s pre-delete hook (`baton remove-deployments`): every PDDeployment is
deleted and waited for while the operator still runs, so none is left on its finalizer."""

from __future__ import annotations

import kopf
import pytest
from operator_harness import NAMESPACE, FakeWorker, api, eventually
from test_operator_kmock import NAME, PDD, make_all_ready, objects, pdd_body, pods

from baton.operator.kube import KubeApi
from baton.operator.uninstall import remove_deployments

pytestmark = pytest.mark.asyncio


async def test_the_hook_deletes_and_waits_while_the_operator_drains(
        emulator, operator_factory, fake_worker):
    fake_worker.drain_finished = False
    client = KubeApi(kopf.ConnectionInfo(server=str(emulator.url).rstrip("/")), timeout=5.0)
    try:
        async with operator_factory():
            await api(emulator, "POST", PDD, pdd_body())
            await eventually(lambda: len(pods(emulator)) == 2, what="2 pods")
            await make_all_ready(emulator, FakeWorker.HOSTS[1:])
            # workers still draining: the hook gives up at its deadline and names what is left
            left = await remove_deployments(client, [], timeout_s=1.0, poll_s=0.1)
            assert left == [f"{NAMESPACE}/{NAME}"]
            assert fake_worker.paths("POST").count("/internal/drain") == 2
            fake_worker.drain_finished = True
            assert await remove_deployments(client, [NAMESPACE], timeout_s=20, poll_s=0.1) == []
        assert not objects(emulator, "baton.dev/v1alpha1/pddeployments") and not pods(emulator)
    finally:
        await client.aclose()


async def test_without_an_operator_the_hook_reports_the_stuck_ones(emulator):
    body = pdd_body()
    body["metadata"]["finalizers"] = ["baton.dev/operator"]  # put there by an operator now gone
    await api(emulator, "POST", PDD, body)
    client = KubeApi(kopf.ConnectionInfo(server=str(emulator.url).rstrip("/")), timeout=5.0)
    try:
        assert await remove_deployments(client, [], timeout_s=0.3, poll_s=0.1) == [
            f"{NAMESPACE}/{NAME}"]
    finally:
        await client.aclose()
