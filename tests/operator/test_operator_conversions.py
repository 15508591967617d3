"""Several conversions at once through the Kubernetes actuator, surviving an operator restart.

The autoscaler's actuator names three pods in one status.target patch, within the workers'
PodDisruptionBudget (5% of 42 pods rounds up to 3); the operator drains all three side by
side, is stopped half-way, and a new operator finishes them: every pod ends in its new role.
"""

from __future__ import annotations

import kopf
import pytest
from operator_harness import NAMESPACE, api, eventually
from test_operator_kmock import NAME, PDD, make_all_ready, pdd_body, pdd_status, pods

from baton.autoscaler.estimate import PoolState
from baton.autoscaler.inputs import Action, Decision
from baton.operator.autoscaling.actuator import KubernetesActuator
from baton.operator.kube import KubeApi

pytestmark = pytest.mark.asyncio
PREFILL, DECODE = 30, 12


async def test_three_conversions_in_flight_survive_an_operator_restart(emulator, operator_factory, fake_worker):
    fake_worker.drain_finished = False
    client = KubeApi(kopf.ConnectionInfo(server=str(emulator.url).rstrip("/")), timeout=5.0)
    actuator = KubernetesActuator(client, NAMESPACE, NAME)
    try:
        async with operator_factory():
            bounds = {"min": 1, "max": PREFILL + DECODE}
            await api(emulator, "POST", PDD, pdd_body(
                prefill={"replicas": PREFILL}, decode={"replicas": DECODE},
                autoscaling={"enabled": True, "prefill": bounds, "decode": bounds}))
            await eventually(lambda: len(pods(emulator)) == PREFILL + DECODE, what="all pods")
            await make_all_ready(emulator)
            await eventually(lambda: pdd_status(emulator).get("prefill", {}).get("ready") == PREFILL,
                             what="prefill pods ready")
            assert await actuator.pools() == PoolState(PREFILL, DECODE, 0)
            decision = Decision(Action.CONVERT_PREFILL_TO_DECODE, (PREFILL, DECODE), (PREFILL - 3, DECODE + 3),
                                (PREFILL - 3, DECODE + 3), "test")
            said = await actuator.apply(decision)
            chosen = said.split("pod(s) ")[1].split(" to ")[0].split(", ")
            assert len(chosen) == 3
            await eventually(lambda: all(pods(emulator)[n]["metadata"]["labels"]["baton.dev/state"] == "draining"
                                         for n in chosen), what="three drains started")
            in_flight = await eventually(lambda: len(pdd_status(emulator).get("conversions", [])) == 3
                                         and pdd_status(emulator)["conversions"], what="status shows each")
            assert sorted(c["pod"] for c in in_flight) == sorted(chosen)
            assert all(c["toRole"] == "decode" and c["phase"] == "Draining" for c in in_flight)
            assert (await actuator.pools()).in_flight == 3
        # The operator is gone half-way; the workers finish draining meanwhile.
        assert "/internal/role" not in fake_worker.paths("POST")
        fake_worker.drain_finished = True
        async with operator_factory():
            await eventually(lambda: all(pods(emulator)[n]["metadata"]["labels"]["baton.dev/role"] == "decode"
                                         for n in chosen), what="all three relabelled to decode")
            await eventually(lambda: pdd_status(emulator).get("conversions") == [], what="none in flight")
        for name in chosen:
            assert pods(emulator)[name]["metadata"]["labels"]["baton.dev/state"] == "active"
        assert len(pods(emulator)) == PREFILL + DECODE  # converted in place
        assert len(pods(emulator, "decode")) == DECODE + 3
        assert fake_worker.paths("POST").count("/internal/role") == 3
        after = await actuator.pools()
        assert after == PoolState(PREFILL - 3, DECODE + 3, 0, conversion_s=after.conversion_s)
        assert after.conversion_s > 0  # timed from the patch to the relabel, the operator restart between
    finally:
        await client.aclose()
