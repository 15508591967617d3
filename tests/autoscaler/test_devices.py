"""Pools counted in devices: per-worker devices, the device-budget split, and the policy's
decisions and explanations for pools of different tensor-parallel sizes (pure)."""

from __future__ import annotations

import pytest
from test_policy import CHAT, DOCS, _config, _obs
from test_sizing import _load

from baton.autoscaler import sizing
from baton.autoscaler.devices import WorkerDevices, convertible_devices, own_pool_devices
from baton.autoscaler.inputs import Action
from baton.autoscaler.policy import SizingPolicy


def test_convertible_workers_hold_the_larger_pools_devices():
    devices = convertible_devices(2, 1)
    assert (devices.prefill, devices.decode) == (2, 2)
    assert devices.fleet(3, 1) == 8
    # a conversion frees one worker's devices, and they hold one worker of the other pool
    assert devices.workers_from_conversion("prefill") == 1
    assert devices.workers_from_conversion("decode") == 1
    assert convertible_devices(1, 1).counted_in_workers
    assert not devices.counted_in_workers


def test_pools_that_never_convert_hold_their_own_sizes():
    devices = own_pool_devices(4, 1)
    assert devices.fleet(1, 3) == 7
    assert devices.workers_from_conversion("prefill") == 4  # its 4 devices hold 4 decode workers
    assert devices.workers_from_conversion("decode") == 0  # one device holds no prefill worker
    with pytest.raises(ValueError):
        WorkerDevices(0, 1)


def test_a_device_budget_of_one_per_worker_is_the_worker_split():
    for total in (2, 5, 8, 13):
        assert (sizing.best_split_within_devices(_load(), total, WorkerDevices())
                == sizing.best_fixed_split(_load(), total))


def test_equal_devices_per_worker_split_the_same_workers():
    # every worker holds 2: 16 devices are 8 workers, split as 8 workers would be
    assert (sizing.best_split_within_devices(_load(), 16, convertible_devices(2, 1))
            == sizing.best_fixed_split(_load(), 8))


def test_the_split_fits_the_device_budget_and_decode_takes_the_rest():
    per_worker = own_pool_devices(4, 1)
    best = sizing.best_split_within_devices(_load(), 20, per_worker)
    used = per_worker.fleet(best.prefill_workers, best.decode_workers)
    assert used <= 20 and 20 - used < per_worker.decode  # no whole decode worker left out
    candidates = [sizing.assess_split(_load(), x, 20 - 4 * x) for x in range(1, 5)]
    meeting = [c for c in candidates if c.meets_slo] or candidates
    assert best.headroom == max(c.headroom for c in meeting)
    with pytest.raises(ValueError, match="devices"):
        sizing.best_split_within_devices(_load(), 4, per_worker)  # 4 for prefill, none for decode


def test_tp_one_decisions_are_unchanged_and_say_nothing_of_devices():
    plain = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0)).decide(_obs(30, 12, 4, CHAT))
    explicit = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0, prefill_tensor_parallel=1,
                                    decode_tensor_parallel=1)).decide(_obs(30, 12, 4, CHAT))
    assert plain == explicit and "device" not in plain.explanation
    assert "fleet_devices" not in plain.outputs


def test_tensor_parallel_pools_convert_one_for_one_within_their_devices():
    # per-worker rates are measured per worker at its pool's TP: the same observation
    config = _config(persist_periods=1, cooldown_s=0.0, prefill_tensor_parallel=2, decode_tensor_parallel=1)
    tp = SizingPolicy(config).decide(_obs(30, 12, 4, CHAT))
    plain = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0)).decide(_obs(30, 12, 4, CHAT))
    assert tp.action is Action.CONVERT_PREFILL_TO_DECODE and tp.target == (11, 5)
    assert tp.desired == plain.desired  # the sizes per worker do not change the workers wanted
    x, y = tp.desired
    assert x * 2 + y * 1 <= 32  # the plan fits the devices of a fleet of pods sized for TP 2
    assert tp.outputs["fleet_devices"] == 32 and tp.outputs["desired_devices"] == 32
    assert tp.outputs["prefill_devices_per_worker"] == tp.outputs["decode_devices_per_worker"] == 2
    assert "32 devices, 2 per worker (prefill TP 2, decode TP 1" in tp.explanation


def test_a_hold_of_tensor_parallel_pools_explains_devices_too():
    config = _config(prefill_tensor_parallel=1, decode_tensor_parallel=4)
    hold = SizingPolicy(config).decide(_obs(30, 9, 7, DOCS))
    assert hold.action is Action.HOLD and "64 devices, 4 per worker" in hold.explanation
