"""What `baton up` starts: worker roles, ports and cores (pure)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class WorkerPlan:
    index: int
    role: str  # prefill | decode | both
    cores: tuple[int, ...] = ()  # pinned CPU cores, shared out among its tensor-parallel ranks
    tensor_parallel_size: int = 1
    # at SCHED_IDLE (baton up --prefill-cpu-priority idle): the router's and the decode
    # workers' threads that wake up go to its cores, not a decode step's
    yields_cpu: bool = False


def plan_roles(prefill: int, decode: int, colocated: int) -> list[str]:
    counts = {"--prefill": prefill, "--decode": decode, "--colocated": colocated}
    negative = [f"{flag} {count}" for flag, count in counts.items() if count < 0]
    if negative:
        raise ValueError(f"worker counts cannot be negative: {', '.join(negative)}")
    if colocated and (prefill or decode):
        raise ValueError("use either --colocated N or --prefill N --decode M, not both")
    if colocated:
        return ["both"] * colocated
    if prefill and not decode:
        raise ValueError("a disaggregated stack needs at least one decode worker")
    if not prefill and not decode:
        return ["prefill", "decode"]  # the default: one of each
    return ["prefill"] * prefill + ["decode"] * decode


def plan_workers(roles: list[str], cores: list[int], prefill_tp: int = 1, decode_tp: int = 1,
                 convertible: bool = False, prefill_yields: bool = False) -> list[WorkerPlan]:
    """Each worker takes the next cores, one per rank, round robin: workers share cores only
    when there are more ranks than cores. Colocated workers decode: they take `decode_tp`.
    `convertible` (--autoscale): a worker may be converted to the other pool and regroup onto
    its size in place, so each holds the larger pool's cores from the start (as a pod asks
    for the larger pool's devices) and its ranks share them out. `prefill_yields`: a one-process
    prefill worker whose cores no other worker shares yields them (SCHED_IDLE); one sharing a
    core with a busy worker would starve, and a converted one would have to leave SCHED_IDLE,
    which takes privilege."""
    if prefill_tp < 1 or decode_tp < 1:
        raise ValueError(f"--prefill-tp and --decode-tp must be at least 1, got {prefill_tp} and {decode_tp}")
    plans, next_core = [], 0
    for i, role in enumerate(roles):
        tp = prefill_tp if role == "prefill" else decode_tp
        held = max(prefill_tp, decode_tp) if convertible else tp
        mine = tuple(cores[(next_core + c) % len(cores)] for c in range(held)) if cores else ()
        next_core += held
        plans.append(WorkerPlan(i, role, mine, tp))
    if not prefill_yields or convertible:
        return plans
    holders = Counter(core for plan in plans for core in plan.cores)
    return [replace(plan, yields_cpu=True) if plan.role == "prefill" and plan.tensor_parallel_size == 1
            and plan.cores and all(holders[core] == 1 for core in plan.cores) else plan for plan in plans]


def worker_args(plan: WorkerPlan, port: int, kv_port: int, host: str, advertise_host: str,
                model: str | None, chunk_size: int | None, peers: list[str], extra: list[str],
                ray_address: str | None = None) -> list[str]:
    args = ["--role", plan.role, "--host", host, "--port", str(port), "--kv-port", str(kv_port),
            "--advertise-host", advertise_host, "--worker-id", f"{plan.role}-{plan.index}"]
    if ray_address:  # its other tensor-parallel ranks, now or after a conversion, go through Ray
        args += ["--ray-address", ray_address]
    for core in plan.cores:  # each rank's torch threads: one per core of its share
        args += ["--cpu-core", str(core)]
    if plan.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(plan.tensor_parallel_size)]
    if plan.yields_cpu:  # before `extra`: a --worker-arg may set it back
        args += ["--prefill-cpu-priority", "idle"]
    if model:
        args += ["--model", model]
    if chunk_size is not None:  # every role: a prefill worker's chunk is what a short prompt waits for
        args += ["--chunk-size", str(chunk_size)]
    if peers and plan.role in ("decode", "both"):
        args += ["--peers", ",".join(peers)]
    return args + list(extra)


def ray_cpus(plans: list[WorkerPlan], prefill_tp: int, decode_tp: int) -> int:
    """Logical CPUs for the local Ray instance: one per server (the router's included), and
    for each worker's other ranks, which Ray places with a CPU each, twice the most it may
    run: a change of group size starts the new ranks before the old ones stop."""
    return len(plans) * (1 + 2 * (max(prefill_tp, decode_tp) - 1)) + 1
