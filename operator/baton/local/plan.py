"""What `baton up` starts: worker roles, ports and cores (pure)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerPlan:
    index: int
    role: str  # prefill | decode | both
    core: int | None  # pinned CPU core


def plan_roles(prefill: int, decode: int, colocated: int) -> list[str]:
    if colocated and (prefill or decode):
        raise ValueError("use either --colocated N or --prefill N --decode M, not both")
    if colocated:
        return ["both"] * colocated
    if prefill < 0 or decode < 0 or (prefill and not decode):
        raise ValueError("a disaggregated stack needs at least one decode worker")
    if not prefill and not decode:
        return ["prefill", "decode"]  # the default: one of each
    return ["prefill"] * prefill + ["decode"] * decode


def plan_workers(roles: list[str], cores: list[int]) -> list[WorkerPlan]:
    """One worker per core, round robin when there are more workers than cores."""
    return [WorkerPlan(i, role, cores[i % len(cores)] if cores else None) for i, role in enumerate(roles)]


def worker_args(plan: WorkerPlan, port: int, kv_port: int, host: str, advertise_host: str,
                model: str | None, chunk_size: int | None, peers: list[str], extra: list[str]) -> list[str]:
    args = ["--role", plan.role, "--host", host, "--port", str(port), "--kv-port", str(kv_port),
            "--advertise-host", advertise_host, "--worker-id", f"{plan.role}-{plan.index}"]
    if plan.core is not None:
        args += ["--cpu-core", str(plan.core), "--threads", "1"]
    if model:
        args += ["--model", model]
    if chunk_size is not None and plan.role != "prefill":  # chunking protects decodes
        args += ["--chunk-size", str(chunk_size)]
    if peers and plan.role in ("decode", "both"):
        args += ["--peers", ",".join(peers)]
    return args + list(extra)
