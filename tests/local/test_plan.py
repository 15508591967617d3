"""What `baton up` starts (pure): roles, cores per tensor-parallel rank, worker arguments."""

from __future__ import annotations

import argparse

import pytest

from baton.local.autoscale import pool_sizes
from baton.local.plan import WorkerPlan, plan_roles, plan_workers, worker_args
from baton.local.runtime import StackSpec
from baton.local.up import add_arguments, spec_from_args


def test_one_core_a_worker_round_robin_without_tensor_parallelism():
    plans = plan_workers(["prefill", "decode", "decode"], [0, 1])
    assert [(p.cores, p.tensor_parallel_size) for p in plans] == [((0,), 1), ((1,), 1), ((0,), 1)]


def test_each_rank_takes_the_next_core():
    plans = plan_workers(plan_roles(1, 1, 0), [0, 1, 2, 3], prefill_tp=2, decode_tp=2)
    assert [(p.role, p.cores, p.tensor_parallel_size) for p in plans] == [
        ("prefill", (0, 1), 2), ("decode", (2, 3), 2)]
    plans = plan_workers(plan_roles(1, 1, 0), [0, 1], prefill_tp=2, decode_tp=1)
    assert [p.cores for p in plans] == [(0, 1), (0,)]  # more ranks than cores: shared


def test_convertible_workers_hold_the_larger_pools_cores():
    # --autoscale: a worker regroups in place when converted, so it holds max(a, b) cores
    plans = plan_workers(plan_roles(1, 2, 0), list(range(8)), prefill_tp=2, decode_tp=1, convertible=True)
    assert [(p.role, p.cores, p.tensor_parallel_size) for p in plans] == [
        ("prefill", (0, 1), 2), ("decode", (2, 3), 1), ("decode", (4, 5), 1)]
    fixed = plan_workers(plan_roles(1, 2, 0), list(range(8)), prefill_tp=2, decode_tp=1)
    assert [p.cores for p in fixed] == [(0, 1), (2,), (3,)]
    up = argparse.ArgumentParser()
    add_arguments(up)
    assert spec_from_args(up.parse_args(["--autoscale", "--prefill-tp", "2"])).convertible
    assert not spec_from_args(up.parse_args(["--prefill-tp", "2"])).convertible


def test_colocated_workers_take_the_decode_size():
    plans = plan_workers(plan_roles(0, 0, 2), [0, 1, 2, 3], prefill_tp=3, decode_tp=2)
    assert [p.tensor_parallel_size for p in plans] == [2, 2]


def test_no_affinity_pins_nothing():
    [plan] = plan_workers(["both"], [], decode_tp=2)
    assert plan.cores == () and "--cpu-core" not in worker_args(plan, 1, 2, "h", "a", None, None, [], [])


def test_a_prefill_worker_yields_the_cpu_when_asked_and_only_on_cores_of_its_own():
    def yielding(plans):
        return [p.role for p in plans if p.yields_cpu]

    assert yielding(plan_workers(plan_roles(1, 1, 0), [0, 1])) == []  # not by default
    assert yielding(plan_workers(plan_roles(1, 1, 0), [0, 1], prefill_yields=True)) == ["prefill"]
    assert yielding(plan_workers(plan_roles(2, 2, 0), [0, 1, 2, 3], prefill_yields=True)) == ["prefill", "prefill"]
    # more workers than cores: prefill-0 shares core 0 with decode-2, which would starve it
    assert yielding(plan_workers(plan_roles(1, 2, 0), [0, 1], prefill_yields=True)) == []
    assert yielding(plan_workers(plan_roles(1, 1, 0), [], prefill_yields=True)) == []  # nothing pinned
    assert yielding(plan_workers(plan_roles(0, 0, 2), [0, 1], prefill_yields=True)) == []  # they decode
    # ranks in processes of their own would keep the normal policy; a converted worker
    # would have to leave SCHED_IDLE, which takes privilege
    assert yielding(plan_workers(plan_roles(1, 1, 0), [0, 1, 2], prefill_tp=2, prefill_yields=True)) == []
    assert yielding(plan_workers(plan_roles(1, 1, 0), [0, 1], convertible=True, prefill_yields=True)) == []
    [prefill, decode] = plan_workers(plan_roles(1, 1, 0), [0, 1], prefill_yields=True)
    args = worker_args(prefill, 1, 2, "h", "a", None, None, [], ["--prefill-cpu-priority=normal"])
    assert args[args.index("--prefill-cpu-priority") + 1] == "idle"
    assert args[-1] == "--prefill-cpu-priority=normal"  # a --worker-arg comes later and wins
    assert "--prefill-cpu-priority" not in worker_args(decode, 1, 2, "h", "a", None, None, [], [])
    up = argparse.ArgumentParser()
    add_arguments(up)
    assert spec_from_args(up.parse_args(["--prefill-cpu-priority", "idle"])).prefill_cpu_priority == "idle"
    assert spec_from_args(up.parse_args([])).prefill_cpu_priority == "normal"


@pytest.mark.parametrize("sizes", [(0, 1), (1, -2)])
def test_a_size_below_one_is_refused_naming_both_flags(sizes):
    with pytest.raises(ValueError, match="--prefill-tp and --decode-tp must be at least 1"):
        plan_workers(["prefill", "decode"], [0], *sizes)


def test_worker_arguments_pin_every_rank_and_name_the_size():
    args = worker_args(WorkerPlan(1, "decode", (2, 3), 2), 8101, 8102, "127.0.0.1", "127.0.0.1",
                       None, 64, ["http://peer"], ["--dtype=float32"])
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--cpu-core"] == ["2", "3"]
    assert "--threads" not in args  # each rank runs a thread per core of its share
    single = worker_args(WorkerPlan(0, "prefill", (0,)), 1, 2, "h", "a", None, None, [], [])
    assert "--tensor-parallel-size" not in single and "--chunk-size" not in single
    chunked = worker_args(WorkerPlan(0, "prefill", (0,)), 1, 2, "h", "a", None, 256, [], [])
    assert chunked[chunked.index("--chunk-size") + 1] == "256"  # every role takes the stack's chunk


def test_autoscaled_conversions_carry_the_pool_sizes_only_where_they_differ():
    assert pool_sizes(StackSpec(prefill=1, decode=1, prefill_tp=2, decode_tp=1)) == {"prefill": 2, "decode": 1}
    assert pool_sizes(StackSpec(prefill=1, decode=1, prefill_tp=2, decode_tp=2)) == {}


def test_kv_cache_dtype_and_router_arguments_reach_their_processes():
    up = argparse.ArgumentParser()
    add_arguments(up)
    spec = spec_from_args(up.parse_args(["--kv-cache-dtype", "float32", "--router-arg=--reserve-wait=3"]))
    assert "--kv-cache-dtype=float32" in spec.worker_args and spec.router_args == ["--reserve-wait=3"]
    default = spec_from_args(up.parse_args([]))
    assert not any("kv-cache-dtype" in a for a in default.worker_args) and default.router_args == []
    with pytest.raises(SystemExit):
        up.parse_args(["--kv-cache-dtype", "int8"])


def test_rank_placement_reaches_the_workers_only_when_spread():
    from baton.server.main import add_arguments as worker_arguments
    from baton.server.main import settings_from_args

    up = argparse.ArgumentParser()
    add_arguments(up)
    spread = spec_from_args(up.parse_args(["--rank-placement", "spread", "--address", "10.0.0.7:6379"]))
    assert "--rank-placement=spread" in spread.worker_args
    assert not any("rank-placement" in a for a in spec_from_args(up.parse_args([])).worker_args)
    parser = argparse.ArgumentParser()
    worker_arguments(parser)
    worker = settings_from_args(parser.parse_args(["--rank-placement=spread"]))
    assert worker.engine_settings()["rank_placement"] == "spread"


def router_app(*argv: str):
    from baton.router.main import add_arguments as router_arguments
    from baton.router.main import build_app

    parser = argparse.ArgumentParser()
    router_arguments(parser)
    return build_app(parser.parse_args(["--workers", "http://127.0.0.1:1", *argv]))


@pytest.mark.parametrize("wait", ["0", "-1", "nan"])
def test_the_routers_reservation_wait_must_be_positive(wait):
    with pytest.raises(SystemExit, match="--reserve-wait must be a positive number of seconds"):
        router_app("--reserve-wait", wait)


def test_the_routers_reservation_wait_is_its_dispatchers_deadline():
    assert router_app("--reserve-wait", "3").state.dispatcher.deadlines.reserve_wait_s == 3
    assert router_app().state.dispatcher.deadlines.reserve_wait_s == 10  # the default the help names


@pytest.mark.parametrize("weight", ["-0.5", "nan", "inf", "half"])
def test_the_routers_stall_weight_must_be_a_number_at_least_zero(weight):
    with pytest.raises(SystemExit, match=r"stall weight \(--stall-weight, BATON_STALL_WEIGHT\) must be a number >= 0"):
        router_app("--stall-weight", weight)


@pytest.mark.parametrize("threshold", ["-3", "nan", "abc"])
def test_the_routers_threshold_must_be_tokens_or_auto(threshold):
    with pytest.raises(SystemExit, match=f"must be >= 0 tokens or 'auto', got '{threshold}'"):
        router_app("--disagg-threshold", threshold)


@pytest.mark.parametrize("argv, problem", [
    (["--disagg-threshold", "abc"], "threshold must be >= 0 tokens or 'auto', got 'abc'"),
    (["--chunk-size", "-3"], "--chunk-size must be 0 .* got -3"),
    (["--prefill", "-1"], "worker counts cannot be negative: --prefill -1"),
    (["--colocated", "-2"], "worker counts cannot be negative: --colocated -2"),
    (["--prefill", "2"], "needs at least one decode worker"),
    (["--colocated", "2", "--decode-tp", "0"], "--prefill-tp and --decode-tp must be at least 1"),
    (["--port", "70000"], "--port must be 0 .* got 70000"),
])
def test_a_stack_a_server_would_refuse_is_refused_before_anything_starts(argv, problem):
    up = argparse.ArgumentParser()
    add_arguments(up)
    with pytest.raises(ValueError, match=problem):
        spec_from_args(up.parse_args(argv)).check()


def test_an_unknown_prefill_cpu_priority_is_refused_by_name():
    with pytest.raises(ValueError, match="--prefill-cpu-priority must be one of .* got 'low'"):
        StackSpec(prefill_cpu_priority="low").check()


def test_the_default_stacks_pass_the_check():
    for spec in (StackSpec(), StackSpec(colocated=2, chunk_size=0, disagg_threshold="auto"),
                 StackSpec(prefill=1, decode=2, port=0, disagg_threshold="256")):
        spec.check()


def test_the_routers_stall_weight_reaches_its_threshold(monkeypatch):
    from baton.router.threshold import DEFAULT_STALL_WEIGHT

    assert router_app("--stall-weight", "0.5").state.estimator.stall_weight == 0.5
    assert router_app().state.estimator.explain()["stall_weight"] == DEFAULT_STALL_WEIGHT
    monkeypatch.setenv("BATON_STALL_WEIGHT", "1")  # the environment's, as a pod's router reads it
    assert router_app().state.estimator.stall_weight == 1.0


def test_workers_get_the_ray_address_and_ray_counts_their_ranks():
    from baton.local.plan import ray_cpus

    plans = plan_workers(plan_roles(1, 2, 0), [0, 1], prefill_tp=1, decode_tp=2)
    args = worker_args(plans[1], 1, 2, "h", "a", None, None, [], [], "10.0.0.1:6379")
    assert args[args.index("--ray-address") + 1] == "10.0.0.1:6379"
    assert "--ray-address" not in worker_args(plans[1], 1, 2, "h", "a", None, None, [], [])
    # 3 servers and the router, and for each worker one more rank, twice over (a regroup)
    assert ray_cpus(plans, 1, 2) == 3 + 1 + 3 * 2
    assert ray_cpus(plan_workers(["both"], [0]), 1, 1) == 2


def test_a_stacks_ports_are_all_distinct():
    """Chosen together, so the kernel cannot hand one out twice (one at a time, bound and
    closed, it gave two decode workers of one stack the same port)."""
    from baton.local.runtime import free_ports

    for _ in range(20):
        ports = free_ports(16)
        assert len(set(ports)) == 16 and all(0 < p < 65536 for p in ports)


def test_a_stacks_ports_lie_below_the_ephemeral_range_and_skip_taken_ones():
    """Below the range the kernel hands out for port 0, no other process's socket takes one
    of them between the choice and the server's bind."""
    import random
    import socket

    from baton.local.runtime import ephemeral_low, free_ports

    low = ephemeral_low()
    ports = free_ports(8, random.Random(1))
    assert all(low - 16384 <= p < low for p in ports)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))  # the same draw again: its first port is now in use
        again = free_ports(8, random.Random(1))
    assert ports[0] not in again and len(set(again)) == 8 and set(again[:7]) == set(ports[1:])
