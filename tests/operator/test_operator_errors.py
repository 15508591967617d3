"""The API server refuses what the operator asks (quota, admission): the PDDeployment says so."""

from __future__ import annotations

import pytest
from operator_harness import NAMESPACE, api, eventually
from test_operator_kmock import PDD, condition, events_posted, pdd_body, pods

pytestmark = pytest.mark.asyncio
QUOTA = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
         "code": 403, "message": 'pods "x" is forbidden: exceeded quota: compute, requested: '
         'cpu=4, used: cpu=8, limited: cpu=8'}


async def test_a_refused_pod_sets_degraded_with_the_servers_words_then_recovers(
        emulator, operator_factory):
    # the first four pod creations are refused, as a full ResourceQuota would
    emulator[f"post /api/v1/namespaces/{NAMESPACE}/pods"][:4] << 403 << QUOTA
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body())
        degraded = await eventually(lambda: condition(emulator, "Degraded").get("status") == "True"
                                    and condition(emulator, "Degraded"), what="Degraded=True")
        assert degraded["reason"] == "ReconcileError"
        assert "exceeded quota" in degraded["message"] and "creating Pod" in degraded["message"]
        assert condition(emulator, "Ready")["status"] == "False"
        warnings = await eventually(lambda: [r.data for r in events_posted(emulator)
                                             if r.data.get("reason") == "ReconcileError"],
                                    what="a Warning event")
        assert warnings[0]["type"] == "Warning"
        assert "exceeded quota" in warnings[0]["message"]

        # the quota frees up: pods get created and Degraded clears on its own
        await eventually(lambda: len(pods(emulator)) == 2, timeout=20, what="pods after the refusals")
        cleared = await eventually(lambda: condition(emulator, "Degraded").get("status") == "False"
                                   and condition(emulator, "Degraded"), what="Degraded=False")
        assert cleared["reason"] == "AsExpected"
