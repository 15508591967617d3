"""Drains that move sequences: scale-down names the serving decode peers, and deleting a
PDDeployment drains every worker before anything is removed."""

from __future__ import annotations

import pytest
from operator_harness import FakeWorker, api, eventually
from test_operator_kmock import NAME, PDD, make_all_ready, objects, patch_spec, pdd_body, pods

pytestmark = pytest.mark.asyncio
IPS = FakeWorker.HOSTS[1:]  # one pod address each


def state(emulator, name):
    return pods(emulator)[name]["metadata"]["labels"]["baton.dev/state"]


def drain_requests(fake_worker):
    return [(address, body) for address, method, path, body in fake_worker.received
            if method == "POST" and path == "/internal/drain"]


async def test_scale_down_migrates_to_the_serving_decode_peers(emulator, operator_factory, fake_worker):
    fake_worker.drain_finished = False
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body(prefill={"replicas": 1}, decode={"replicas": 2}))
        await eventually(lambda: len(pods(emulator)) == 3, what="3 pods")
        address = await make_all_ready(emulator, IPS)
        await patch_spec(emulator, {"decode": {"replicas": 1}}, generation=2)
        [leaving] = await eventually(lambda: [n for n in pods(emulator, "decode")
                                              if state(emulator, n) == "draining"], what="a drain")
        [request] = await eventually(lambda: drain_requests(fake_worker), what="POST drain")
    [staying] = [n for n in pods(emulator, "decode") if n != leaving]
    assert request[0] == address[leaving]
    # the running sequences go to the decode worker that stays, never to a prefill worker
    assert request[1] == {"peers": [f"http://{address[staying]}:{fake_worker.port}"]}


async def test_deleting_the_deployment_drains_workers_before_removing_them(
        emulator, operator_factory, fake_worker):
    fake_worker.drain_finished = False
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body(prefill={"replicas": 1}, decode={"replicas": 2}))
        await eventually(lambda: len(pods(emulator)) == 3, what="3 pods")
        address = await make_all_ready(emulator, IPS)
        await api(emulator, "DELETE", f"{PDD}/{NAME}")

        await eventually(lambda: len(drain_requests(fake_worker)) == 3, what="every worker drains")
        assert sorted(a for a, _ in drain_requests(fake_worker)) == sorted(address.values())
        assert all(body == {"peers": []} for _, body in drain_requests(fake_worker))
        await eventually(lambda: all(state(emulator, n) == "draining" for n in pods(emulator)),
                         what="all labelled draining")
        # while they drain, the PDDeployment (finalizer), its pods and its router stay
        await eventually(lambda: "/internal/drain" in fake_worker.paths("GET"), what="a poll")
        assert len(pods(emulator)) == 3
        assert objects(emulator, "baton.dev/v1alpha1/pddeployments")
        assert f"{NAME}-router" in objects(emulator, "apps/v1/deployments")

        fake_worker.drain_finished = True
        await eventually(lambda: not objects(emulator, "baton.dev/v1alpha1/pddeployments"),
                         what="finalizer released after the drains")
    assert not pods(emulator)
    assert not objects(emulator, "apps/v1/deployments")
    assert not objects(emulator, "v1/secrets")
