"""Actuators: the PDDeployment's status.target patch (pure), and local conversions over HTTP."""

from __future__ import annotations

import pytest
from fleet_harness import FakeWorker, running_workers

from baton.autoscaler.actuator import ActuationError
from baton.autoscaler.estimate import ConversionTimes, PoolState
from baton.autoscaler.inputs import Action, Decision
from baton.autoscaler.ray_actuator import RayActuator, WorkerState, choose_worker, committed_split
from baton.operator.autoscaling.actuator import (
    KubernetesActuator,
    pending_conversions,
    pool_state,
    target_patch,
)
from baton.operator.desired import Desired
from baton.operator.planning import PodView


def raw_pod(name, role, state="active", ready=True, created="2025-01-01T00:00:00Z"):
    return {
        "metadata": {"name": name, "creationTimestamp": created,
                     "labels": {"baton.dev/role": role, "baton.dev/state": state}},
        "status": {"phase": "Running", "podIP": "10.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def pod(name, role, state="active", ready=True, created="2025-01-01T00:00:00Z"):
    return PodView.of(raw_pod(name, role, state, ready, created))


def decision(action, current, target):
    return Decision(action, current, target, target, "because")


SIZES = Desired(1, 2)


def test_conversion_patch_names_the_newest_serving_pod_and_the_new_sizes():
    pods = [pod("p1", "prefill"), pod("d-old", "decode"),
            pod("d-new", "decode", created="2025-02-01T00:00:00Z"),
            pod("d-unready", "decode", ready=False, created="2025-03-01T00:00:00Z")]
    patch = target_patch(SIZES, pods, decision(Action.CONVERT_DECODE_TO_PREFILL, (1, 2), (2, 1)))
    # the controller's target goes to status: the spec is the user's, never patched
    assert patch == {"status": {"target": {"prefill": 2, "decode": 1, "conversions": [
        {"pod": "d-new", "toRole": "prefill"}]}}}


def test_pending_conversions_are_kept_and_finished_ones_dropped():
    desired = Desired(1, 2, {"done": "prefill", "busy": "prefill", "gone": "decode"})
    pods = [pod("done", "prefill"), pod("busy", "decode", state="draining"), pod("p", "prefill"),
            pod("d", "decode")]
    assert pending_conversions(desired, pods) == [{"pod": "busy", "toRole": "prefill"}]
    assert pool_state(desired, pods) == PoolState(1, 2, in_flight=1)
    patch = target_patch(desired, pods, decision(Action.CONVERT_PREFILL_TO_DECODE, (2, 1), (1, 2)))
    assert patch["status"]["target"]["conversions"] == [{"pod": "busy", "toRole": "prefill"},
                                                        {"pod": "p", "toRole": "decode"}]


def test_scaling_writes_sizes_keeps_pending_conversions_and_nothing_to_convert_is_an_error():
    patch = target_patch(SIZES, [], decision(Action.SCALE_POOLS, (1, 2), (2, 3)))
    assert patch == {"status": {"target": {"prefill": 2, "decode": 3, "conversions": []}}}
    busy = Desired(1, 2, {"b": "decode"})
    kept = target_patch(busy, [pod("b", "prefill", state="draining")],
                        decision(Action.SCALE_POOLS, (1, 2), (1, 3)))
    assert kept["status"]["target"]["conversions"] == [{"pod": "b", "toRole": "decode"}]
    with pytest.raises(ActuationError, match="no serving decode pod"):
        target_patch(SIZES, [pod("d", "decode", state="draining")],
                     decision(Action.CONVERT_DECODE_TO_PREFILL, (1, 2), (2, 1)))


def test_local_choice_and_split():
    states = [WorkerState("a", "decode", "active", 5), WorkerState("b", "decode", "active", 1),
              WorkerState("c", "prefill", "active", 0), WorkerState("e", "decode", "draining", 0)]
    assert choose_worker(states, "decode", set()).url == "b"
    assert choose_worker(states, "decode", {"b"}).url == "a"
    assert committed_split(states, {"b": "prefill"}) == PoolState(2, 2, in_flight=2)


@pytest.mark.asyncio
async def test_local_conversion_drains_with_peers_then_switches_role():
    workers = [FakeWorker("prefill"), FakeWorker("decode", drain_polls=2), FakeWorker("decode")]
    for worker in workers:
        await worker.start()
    events = []
    moments = iter([100.0, 104.5])  # the request, then the role switch
    actuator = RayActuator([w.url for w in workers], token="secret", poll_s=0.01,
                           on_event=lambda reason, message: events.append(reason),
                           clock=lambda: next(moments))
    try:
        assert await actuator.pools() == PoolState(1, 2, 0)
        done = await actuator.apply(decision(Action.CONVERT_DECODE_TO_PREFILL, (1, 2), (2, 1)))
        assert "to prefill" in done
        assert (await actuator.pools()).in_flight == 1
        await actuator.wait_idle()
        assert await actuator.pools() == PoolState(2, 1, 0, conversion_s=4.5)  # the measured time to convert
        with pytest.raises(ActuationError, match="no pool-scaling hook"):
            await actuator.apply(decision(Action.SCALE_POOLS, (2, 1), (2, 2)))
    finally:
        await actuator.aclose()
        for worker in workers:
            await worker.stop()
    converted = next(w for w in workers[1:] if w.metrics.role == "prefill")
    other = next(w for w in workers[1:] if w is not converted)
    methods = [(m, p) for m, p, _ in converted.calls]
    assert methods[0] == ("POST", "/internal/drain")
    assert converted.calls[0][2] == {"peers": [other.url]}
    assert methods[-1] == ("POST", "/internal/role") and converted.calls[-1][2] == {"role": "prefill"}
    assert events == ["ConversionStarted", "ConversionFinished"]


@pytest.mark.asyncio
async def test_local_drain_deadline_and_scaling_hook():
    stuck = FakeWorker("decode", drain_polls=10_000)
    await stuck.start()
    asked = []

    async def scale(prefill, decode):
        asked.append((prefill, decode))

    events = []
    actuator = RayActuator([stuck.url], drain_timeout_s=0.05, poll_s=0.01, scale=scale,
                           on_event=lambda reason, message: events.append(reason))
    try:
        assert await actuator.convert(stuck.url, "decode", "prefill", [])
        await actuator.apply(decision(Action.SCALE_POOLS, (1, 1), (1, 3)))
    finally:
        await actuator.aclose()
        await stuck.stop()
    assert events == ["ConversionStarted", "DrainTimeout", "ConversionFinished"]
    assert asked == [(1, 3)]


@pytest.mark.asyncio
async def test_local_split_counts_the_workers_that_did_not_answer():
    async with running_workers("prefill", "decode") as workers:
        actuator = RayActuator([w.url for w in workers], timeout=1.0)
        try:
            assert await actuator.pools() == PoolState(1, 1, 0, unreachable=0)
            await workers[0].stop()
            assert await actuator.pools() == PoolState(0, 1, 0, unreachable=1)
        finally:
            await actuator.aclose()


def test_several_conversions_name_several_pods_within_the_disruption_budget():
    from baton.operator.autoscaling.actuator import disruption_allowance

    pods = [pod(f"p{i}", "prefill", created=f"2025-01-0{i + 1}T00:00:00Z") for i in range(5)]
    pods += [pod("d0", "decode"), pod("d1", "decode", state="draining")]
    # 7 pods at 50% round up to 4, less the one draining.
    assert disruption_allowance("50%", pods) == 3
    assert disruption_allowance(2, pods) == 1
    assert disruption_allowance(None, pods) is None
    sizes = Desired(5, 2)
    asked = decision(Action.CONVERT_PREFILL_TO_DECODE, (5, 2), (1, 6))  # four workers
    target = target_patch(sizes, pods, asked, allowance=3)["status"]["target"]
    assert target["conversions"] == [{"pod": n, "toRole": "decode"} for n in ("p4", "p3", "p2")]
    assert (target["prefill"], target["decode"]) == (2, 5)
    assert len(target_patch(sizes, pods, asked)["status"]["target"]["conversions"]) == 4
    with pytest.raises(ActuationError, match="disruption budget"):
        target_patch(sizes, pods, asked, allowance=0)


@pytest.mark.asyncio
async def test_local_actuator_runs_several_conversions_side_by_side():
    workers = [FakeWorker("prefill", drain_polls=3) for _ in range(3)] + [FakeWorker("decode")]
    for worker in workers:
        await worker.start()
    actuator = RayActuator([w.url for w in workers], token="secret", poll_s=0.01)
    try:
        done = await actuator.apply(decision(Action.CONVERT_PREFILL_TO_DECODE, (3, 1), (1, 3)))
        assert done.count("to decode") == 2
        assert await actuator.pools() == PoolState(1, 3, 2)  # committed split, both in flight
        await actuator.wait_idle()
        after = await actuator.pools()
        assert (after.prefill, after.decode, after.in_flight) == (1, 3, 0) and after.conversion_s >= 0
    finally:
        await actuator.aclose()
        for worker in workers:
            await worker.stop()
    converted = [w for w in workers[:3] if w.metrics.role == "decode"]
    assert len(converted) == 2
    for worker in converted:  # sessions go only to the decode worker that stays decode
        assert worker.calls[0][2] == {"peers": [workers[3].url]}


class FakeKube:
    """The PDDeployment, its worker pods and its disruption budget, as KubeApi answers them."""

    def __init__(self, spec, pods):
        self.spec, self.status, self.pods = spec, {}, pods
        self.patched: list[tuple[str | None, dict]] = []

    async def get(self, kind, namespace, name):
        if kind == "PDDeployment":
            return {"spec": self.spec, "status": self.status}
        return {"spec": {"maxUnavailable": "50%"}}

    async def list(self, kind, namespace, selector):
        return self.pods

    async def patch(self, kind, namespace, name, patch, sub=None):
        self.patched.append((sub, patch))
        assert sub == "status" and set(patch) == {"status"}  # never the user's spec
        self.status = {**self.status, **patch["status"]}


AUTOSCALED = {"image": "w", "prefill": {"replicas": 1}, "decode": {"replicas": 3},
              "autoscaling": {"enabled": True, "prefill": {"min": 1, "max": 4},
                              "decode": {"min": 1, "max": 4}}}


@pytest.mark.asyncio
async def test_kubernetes_actuator_times_the_conversions_it_requests():
    kube = FakeKube(AUTOSCALED,
                    [raw_pod("p1", "prefill"), raw_pod("d1", "decode"), raw_pod("d2", "decode"),
                     raw_pod("d3", "decode", created="2025-02-01T00:00:00Z")])
    now = [100.0]
    actuator = KubernetesActuator(kube, "ns", "pd", clock=lambda: now[0])
    assert (await actuator.pools()).conversion_s is None  # nothing measured yet
    await actuator.apply(Decision(Action.CONVERT_DECODE_TO_PREFILL, (1, 3), (3, 1), (3, 1), "because"))
    assert kube.spec == AUTOSCALED
    chosen = [c["pod"] for c in kube.status["target"]["conversions"]]
    assert chosen == ["d3", "d2"]
    kube.pods = [raw_pod("p1", "prefill"), raw_pod("d1", "decode"), raw_pod("d2", "decode", state="draining"),
                 raw_pod("d3", "decode", state="draining")]
    now[0] = 130.0
    assert await actuator.pools() == PoolState(3, 1, in_flight=2)
    # d3 serves as prefill 42 s after the request; d2 is deleted before it converts (not timed).
    kube.pods = [raw_pod("p1", "prefill"), raw_pod("d1", "decode"), raw_pod("d3", "prefill")]
    now[0] = 142.0
    assert await actuator.pools() == PoolState(3, 1, in_flight=0, conversion_s=42.0)


def test_conversion_times_keep_the_slowest_recent_one():
    times = ConversionTimes(keep=2)
    for name, begun, done in (("a", 0.0, 90.0), ("b", 10.0, 40.0), ("c", 20.0, 45.0)):
        times.started(name, begun)
        times.finished(name, done)
    assert times.seconds == 30.0  # the 90 s conversion is no longer among the last two
    times.finished("never-started", 50.0)
    times.follow(set(), 60.0)
    assert times.seconds == 30.0
