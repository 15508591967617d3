"""The loop: measure -> observation -> policy -> actuator, and how each decision is explained."""

from __future__ import annotations

import datetime as dt

import pytest
from prometheus_client import CollectorRegistry

from baton.api import parse_spec
from baton.api.models import Autoscaling, SizingDecision
from baton.autoscaler.actuator import ActuationError
from baton.autoscaler.estimate import ObservationBuilder, PoolState, kv_capacity_from_usage
from baton.autoscaler.inputs import Action, PolicyConfig
from baton.autoscaler.instruments import metrics_for
from baton.autoscaler.loop import Controller
from baton.autoscaler.metrics import FleetSnapshot, MetricsUnavailable, StepSample
from baton.autoscaler.policy import SizingPolicy
from baton.local.autoscale import stack_policy
from baton.local.runtime import StackSpec
from baton.operator.autoscaling.daemon import (
    policy_config,
    rate_window,
    replacing_patch,
    spec_policy_config,
    worker_urls,
)

CONFIG = PolicyConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, prefill_bounds=(1, 2), decode_bounds=(1, 2),
                      cooldown_s=0.0)


def long_prompts(**changes) -> FleetSnapshot:
    """1P2D under long prompts: the prefill worker is a third over capacity."""
    values = dict(arrival_rate=10.0, input_len=2000.0, output_len=20.0, hit_rate=0.0,
                  prefill_supply=15_000.0, exposed_transfer_s=None, decode_kv_usage=0.4,
                  decode_running=8.0,
                  step_samples=(StepSample("d1", 8.0, 0.03), StepSample("d2", 8.0, 0.03)),
                  pools={"prefill": 1, "decode": 2, "both": 0})
    return FleetSnapshot(**{**values, **changes})


class ListSource:
    def __init__(self, *snapshots):
        self.snapshots = list(snapshots)

    async def snapshot(self):
        item = self.snapshots.pop(0) if len(self.snapshots) > 1 else self.snapshots[0]
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self):
        pass


class RecordingActuator:
    def __init__(self, pools=None, fail=None):
        self.applied = []
        self._pools = pools
        self.fail = fail

    async def pools(self):
        return self._pools

    async def apply(self, decision):
        if self.fail:
            raise ActuationError(self.fail)
        self.applied.append(decision)
        return "did it"

    async def aclose(self):
        pass


def controller(source, actuator, registry, seen=None):
    clock = iter(range(1000))
    return Controller("demo", source, SizingPolicy(CONFIG), actuator, period_s=1,
                      registry=registry, clock=lambda: float(next(clock)),
                      on_decision=(lambda d, r: seen.append((d, r))) if seen is not None else None,
                      wall=lambda: dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC))


@pytest.mark.asyncio
async def test_long_prompts_convert_decode_to_prefill_and_explain():
    registry, seen = CollectorRegistry(), []
    actuator = RecordingActuator()
    loop = controller(ListSource(long_prompts()), actuator, registry, seen)
    decisions = [await loop.step() for _ in range(3)]
    assert decisions[0].action is Action.HOLD  # the step model needs a few samples
    assert Action.CONVERT_DECODE_TO_PREFILL in {d.action for d in decisions[1:]}
    convert = actuator.applied[0]
    assert convert.target == (2, 1)
    record = next(r for d, r in seen if d.action is not Action.HOLD)
    model = SizingDecision.model_validate(record)  # exactly the API's status shape
    assert model.action == "convert-decode-to-prefill" and model.time == "2025-01-02T03:04:05Z"
    assert "did it" in model.reason and "prefill at 1.33" in model.reason
    assert model.inputs["arrival_rate"] == 10.0 and model.inputs["input_len"] == 2000.0
    assert model.outputs["desired_prefill_workers"] == 2.0
    sample = lambda name, **labels: registry.get_sample_value(name, {"deployment": "demo", **labels})
    assert sample("baton_autoscaler_decisions_total", action="convert-decode-to-prefill") >= 1
    assert sample("baton_autoscaler_decisions_total", action="scale-pools") == 0
    assert sample("baton_autoscaler_desired_workers", pool="prefill") == 2
    assert sample("baton_autoscaler_actual_workers", pool="decode") == 2
    assert sample("baton_autoscaler_arrival_rate") == 10.0
    assert sample("baton_autoscaler_input_length_tokens") == 2000.0
    assert sample("baton_autoscaler_output_length_tokens") == 20.0
    assert sample("baton_autoscaler_prefix_hit_rate") == 0.0
    assert sample("baton_autoscaler_conversions_in_flight") == 0


@pytest.mark.asyncio
async def test_unknown_inputs_hold_and_export_nan():
    registry = CollectorRegistry()
    actuator = RecordingActuator()
    loop = controller(ListSource(long_prompts(arrival_rate=None, input_len=None)), actuator,
                      registry)
    for _ in range(4):
        decision = await loop.step()
        assert decision.action is Action.HOLD
    assert "unknown inputs (arrival_rate, input_len" in decision.explanation
    assert actuator.applied == []
    value = registry.get_sample_value("baton_autoscaler_arrival_rate", {"deployment": "demo"})
    assert value != value  # NaN: a gap on the graph, not a zero


@pytest.mark.asyncio
async def test_unreadable_metrics_hold_with_the_actuators_split():
    actuator = RecordingActuator(pools=PoolState(1, 2, in_flight=0))
    loop = controller(ListSource(MetricsUnavailable("prometheus down")), actuator,
                      CollectorRegistry())
    decision = await loop.step()
    assert decision.action is Action.HOLD and decision.current == (1, 2)
    assert "prometheus down" in loop.status["reason"] and loop.last_error == "prometheus down"


@pytest.mark.asyncio
async def test_no_split_known_means_no_decision():
    loop = controller(ListSource(MetricsUnavailable("down")), RecordingActuator(),
                      CollectorRegistry())
    assert await loop.step() is None and loop.last_error == "down"


@pytest.mark.asyncio
async def test_conversion_in_flight_blocks_another_and_failures_are_reported():
    busy = RecordingActuator(pools=PoolState(1, 2, in_flight=1))
    loop = controller(ListSource(long_prompts()), busy, CollectorRegistry())
    for _ in range(4):
        assert (await loop.step()).action is Action.HOLD
    assert "conversion(s) in flight" in loop.status["reason"]

    failing = RecordingActuator(fail="no serving decode pod to convert")
    loop = controller(ListSource(long_prompts()), failing, CollectorRegistry())
    reasons = [(await loop.step(), loop.status["reason"]) for _ in range(3)]
    assert any("not carried out: no serving decode pod" in r for _, r in reasons)


def test_worker_capacity_is_remembered_traffic_is_not():
    builder = ObservationBuilder()
    first = builder.build(long_prompts(), PoolState(1, 2), 0.0)
    assert first.prefill_supply == 15_000.0
    assert first.kv_capacity_tokens == pytest.approx(8 * 2010 / 0.4)
    idle = long_prompts(arrival_rate=0.0, input_len=None, output_len=None, hit_rate=None,
                        prefill_supply=None, decode_kv_usage=0.0, decode_running=0.0,
                        step_samples=())
    later = builder.build(idle, PoolState(1, 2), 1.0)
    assert later.prefill_supply == 15_000.0 and later.kv_capacity_tokens == first.kv_capacity_tokens
    assert later.input_len is None and "input_len" in later.unknown_fields()
    assert kv_capacity_from_usage(4, 1000, 0.001) is None  # too coarse to divide by
    assert ObservationBuilder(kv_capacity_tokens=5e4).build(idle, PoolState(1, 1), 0).kv_capacity_tokens == 5e4
    # what the decode workers report beats the estimate from usage
    reported = ObservationBuilder().build(long_prompts(decode_kv_capacity=8192.0), PoolState(1, 2), 0.0)
    assert reported.kv_capacity_tokens == 8192.0


def test_the_actuators_time_to_convert_reaches_the_policy():
    builder = ObservationBuilder()
    assert builder.build(long_prompts(), PoolState(1, 2), 0.0).conversion_s is None
    timed = builder.build(long_prompts(), PoolState(2, 1, in_flight=1, conversion_s=40.0), 30.0)
    assert timed.conversion_s == 40.0 and timed.conversions_in_flight == 1


def test_a_window_where_no_request_finished_carries_the_last_traffic_while_requests_run():
    builder = ObservationBuilder(shape_hold_s=20.0)
    builder.build(long_prompts(), PoolState(1, 2), 0.0)
    unfinished = long_prompts(input_len=None, output_len=None, hit_rate=None)  # requests still arrive
    carried = builder.build(unfinished, PoolState(1, 2), 5.0)
    assert (carried.input_len, carried.output_len, carried.hit_rate) == (2000.0, 20.0, 0.0)
    assert carried.carried == ("input_len", "output_len", "hit_rate") and not carried.unknown_fields()
    assert carried.step_intercept_s is not None  # the step line needs the context length
    decision = SizingPolicy(PolicyConfig()).decide(carried)
    assert "input_len, output_len, hit_rate carried from the last window" in decision.explanation
    # a closed loop sends nothing new while nothing finishes: the zero rate is carried over too
    quiet = builder.build(long_prompts(arrival_rate=0.0, input_len=None, output_len=None, hit_rate=None),
                          PoolState(1, 2), 6.0)
    assert quiet.arrival_rate == 10.0 and quiet.carried == ("arrival_rate", "input_len", "output_len", "hit_rate")
    # nothing running and nothing arriving: no traffic, nothing carried
    idle = builder.build(long_prompts(arrival_rate=0.0, input_len=None, output_len=None, hit_rate=None,
                                      decode_running=0.0), PoolState(1, 2), 7.0)
    assert idle.input_len is None and idle.carried == () and "input_len" in idle.unknown_fields()
    # too old: unknown again
    stale = builder.build(unfinished, PoolState(1, 2), 21.0)
    assert stale.input_len is None and "input_len" in stale.unknown_fields()


def test_policy_config_from_the_spec():
    settings = Autoscaling.model_validate({
        "enabled": True, "mode": "elastic", "prefill": {"min": 1, "max": 3},
        "slo": {"ttftSeconds": 0.5, "tpotSeconds": 0.05}, "targetUtilization": 0.7,
        "cooldownSeconds": 10})
    config = policy_config(settings)
    assert config.mode.value == "elastic" and config.prefill_bounds == (1, 3)
    assert config.ttft_slo_s == 0.5 and config.decode_utilisation == 0.7 and config.cooldown_s == 10
    assert rate_window(30) == "60s" and rate_window(45) == "90s"


def test_the_controller_knows_each_pools_tensor_parallel_size():
    spec = parse_spec({"image": "w", "prefill": {"tensorParallelSize": 2},
                       "autoscaling": {"enabled": True, "mode": "fixed-fleet"}})
    config = spec_policy_config(spec)
    assert (config.prefill_tensor_parallel, config.decode_tensor_parallel) == (2, 1)
    assert (config.worker_devices.prefill, config.worker_devices.decode) == (2, 2)
    assert config.mode.value == "fixed-fleet"
    # `baton up --autoscale --prefill-tp 1 --decode-tp 3`
    local = stack_policy(PolicyConfig(cooldown_s=5.0), StackSpec(prefill_tp=1, decode_tp=3))
    assert (local.prefill_tensor_parallel, local.decode_tensor_parallel, local.cooldown_s) == (1, 3, 5.0)


def test_status_patch_replaces_the_previous_decision():
    old = {"action": "hold", "inputs": {"a": 1.0, "b": 2.0}, "outputs": {"x": 1.0}}
    new = {"action": "scale-pools", "inputs": {"a": 3.0}}
    assert replacing_patch(old, new) == {"outputs": None, "action": "scale-pools",
                                         "inputs": {"a": 3.0, "b": None}}
    assert replacing_patch(None, new) == new


def test_scrape_targets_are_running_pods_with_addresses():
    pods = [
        {"metadata": {"name": "a"}, "status": {"phase": "Running", "podIP": "10.0.0.1"}},
        {"metadata": {"name": "b"}, "status": {"phase": "Pending"}},
        {"metadata": {"name": "c"}, "status": {"phase": "Running", "podIP": "fd00::1"}},
    ]
    assert worker_urls(pods, 8100) == ["http://10.0.0.1:8100", "http://[fd00::1]:8100"]


def test_each_new_registry_gets_metrics_registered_in_it():
    # Registries made and dropped in turn reuse one address; each must get its own metrics.
    for _ in range(20):
        registry = CollectorRegistry()
        metrics_for(registry).start("demo")
        assert registry.get_sample_value("baton_autoscaler_decisions_total",
                                         {"deployment": "demo", "action": "hold"}) == 0
        del registry
