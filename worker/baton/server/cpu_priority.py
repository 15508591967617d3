"""The CPU scheduling policy of a worker's threads: prefill work may yield to everything else.

Where a prefill worker shares a machine with decode workers and the router (`baton up`: each
worker pinned to cores of its own, the router and the clients' connections on any core), a
thread that wakes up (the router relaying a token, a decode worker's HTTP or KV thread, Ray's
daemons) lands on whichever core the kernel picks, and may preempt a decode step. Under
SCHED_IDLE the prefill worker's threads run only when nothing else on their cores wants to,
and the kernel counts a core running only SCHED_IDLE threads as idle when it places a woken
thread: the short, latency-bound work goes to the prefill core and the decode cores keep
decoding. The prefill worker pays for the CPU those threads take, so where it is busy its
long prompts wait longer: a trade (docs/benchmarks.md, "Prefill workers at SCHED_IDLE"), off
unless asked for (`--prefill-cpu-priority idle`).

Only a one-process prefill worker takes it (tensor-parallel ranks in other processes would not),
and only while it is one: a worker converted to decoding returns to SCHED_OTHER. Leaving
SCHED_IDLE needs root, CAP_SYS_NICE or an RLIMIT_NICE of 20; without them the worker says so.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

PRIORITIES = ("normal", "idle")
_POLICIES = {"normal": getattr(os, "SCHED_OTHER", 0), "idle": getattr(os, "SCHED_IDLE", 5)}


def check_priority(priority: str, what: str = "CPU priority") -> None:
    """Raise ValueError naming `what` unless `priority` is one of PRIORITIES."""
    if priority not in PRIORITIES:
        raise ValueError(f"{what} must be one of {PRIORITIES}, got {priority!r}")


def priority_for(role: str, prefill_priority: str, tensor_parallel_size: int) -> str:
    """The priority a worker's threads run at in `role`: `prefill_priority` while it is a
    one-process prefill worker, else normal."""
    if role == "prefill" and tensor_parallel_size == 1:
        return prefill_priority
    return "normal"


def policy_name(policy: int) -> str:
    """SCHED_IDLE, SCHED_OTHER, ... for a policy number, as logs and errors name it."""
    names = {getattr(os, n): n for n in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE", "SCHED_FIFO", "SCHED_RR")
             if hasattr(os, n)}
    return names.get(policy, str(policy))


def thread_policies(pid: int | str = "self") -> dict[int, int]:
    """{thread id: scheduling policy} for every live thread of a process."""
    policies = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            policies[int(tid)] = os.sched_getscheduler(int(tid))
        except OSError:  # ended meanwhile
            continue
    return policies


def apply_priority(priority: str, tasks: Path = Path("/proc/self/task")) -> str | None:
    """Move every thread of this process to `priority`'s policy (threads started later inherit
    it from the one that starts them). Returns None, or why it could not: then the threads keep
    the policy they had (each move needs the same permission, so the first is the one refused)."""
    check_priority(priority)
    policy = _POLICIES[priority]
    if not hasattr(os, "sched_setscheduler") or not tasks.is_dir():
        return "this system has no per-thread scheduling policies"
    for tid in sorted(int(t) for t in os.listdir(tasks)):
        try:
            if os.sched_getscheduler(tid) != policy:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # ended meanwhile
            continue
        except PermissionError:
            return (f"not permitted to move its threads to {policy_name(policy)} (leaving SCHED_IDLE "
                    "needs root, CAP_SYS_NICE or an RLIMIT_NICE of 20)")
    return None


def set_worker_priority(name: str, role: str, prefill_priority: str, tensor_parallel_size: int) -> None:
    """Move this worker's threads to the priority for its role, and log it (or why not)."""
    if prefill_priority == "normal":
        return  # never changed: nothing to move back
    priority = priority_for(role, prefill_priority, tensor_parallel_size)
    problem = apply_priority(priority)
    if problem:
        log.warning("worker %s (%s): CPU priority stays as it was, wanted %s: %s", name, role, priority, problem)
    else:
        log.info("worker %s (%s): threads at CPU priority %s (%s)", name, role, priority,
                 policy_name(_POLICIES[priority]))
