"""What one prompt prefilled elsewhere costs each server's CPU, by thread.

A prefill worker, a decode worker and the router (`baton up`'s runtime, the disaggregation
threshold at 0 so every prompt goes remote). Requests go one at a time through the router's
/v1/completions: fresh prompts of `--prompt-len` tokens, `--max-tokens` output tokens each.
Per request: each process's CPU milliseconds, and each worker thread's, by the names the
worker gives its threads (server/thread_names.py). On a decode worker whose streams are
busy, every millisecond its other threads spend on an arrival is taken from its engine's
core (the interference benchmark's waves of arrivals).

    python bench/arrival_cost.py --requests 60   # writes bench/results/arrival_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import httpx
from machine_info import machine_record

from baton.local.runtime import LocalStack, StackSpec

RESULTS = Path(__file__).with_name("results")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def stat_cpu_s(stat: Path) -> float:
    """User + system CPU seconds from a /proc .../stat file (fields after the command)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds by thread name (threads of one name summed; ended threads drop out)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name, spent = (task / "comm").read_text().strip(), stat_cpu_s(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + spent
    return out


def process_cpu_s(pid: int) -> float:
    return stat_cpu_s(Path(f"/proc/{pid}/stat"))


def server_pids(stack: LocalStack) -> dict[str, int]:
    """role -> the server process's pid (each actor reports its own pid, then its server's)."""
    import ray

    pids = {}
    for server in [*stack.workers, stack.router]:
        role = "router" if server is stack.router else server.role
        pids[role] = ray.get(server.actor.pids.remote())[-1]
    return pids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=2, help="output tokens a request")
    parser.add_argument("--out", type=Path, default=RESULTS / "arrival_cost.json")
    args = parser.parse_args()
    if args.requests < 1 or args.prompt_len < 1 or args.max_tokens < 1:
        parser.error("--requests, --prompt-len and --max-tokens must be at least 1")
    machine = machine_record()
    stack = LocalStack(StackSpec(port=0, prefill=1, decode=1, disagg_threshold="0")).start()
    try:
        pids = server_pids(stack)
        with httpx.Client(timeout=120) as http:
            model = http.get(f"{stack.url}/v1/models").json()["data"][0]["id"]

            def request(k: int) -> dict:
                # token ids, each prompt's own from its first: no two share a cached prefix
                prompt = [100 + (7919 * k + 31 * j) % 40_000 for j in range(args.prompt_len)]
                body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": True}
                response = http.post(f"{stack.url}/v1/completions", json=body)
                response.raise_for_status()
                return response.json()["usage"]

            for k in range(3):  # warm: first requests pay one-time costs
                request(10_000 + k)
            before = {role: (process_cpu_s(pid), thread_cpu_s(pid)) for role, pid in pids.items()}
            started = time.perf_counter()
            usage = [request(k) for k in range(args.requests)]
            wall = time.perf_counter() - started
            after = {role: (process_cpu_s(pid), thread_cpu_s(pid)) for role, pid in pids.items()}
    finally:
        stack.stop()
    per_request = {}
    for role in pids:
        (cpu0, threads0), (cpu1, threads1) = before[role], after[role]
        by_thread = {name: round((spent - threads0.get(name, 0.0)) / args.requests * 1e3, 2)
                     for name, spent in threads1.items() if spent - threads0.get(name, 0.0) > 0}
        per_request[role] = {"process_ms": round((cpu1 - cpu0) / args.requests * 1e3, 2),
                             "threads_ms": dict(sorted(by_thread.items(), key=lambda kv: -kv[1]))}
    prompt_tokens = sorted(u["prompt_tokens"] for u in usage)
    out = {"machine": machine, "requests": args.requests, "prompt_tokens_p50": prompt_tokens[len(prompt_tokens) // 2],
           "max_tokens": args.max_tokens, "wall_ms_per_request": round(wall / args.requests * 1e3, 1),
           "cpu_ms_per_request": per_request}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
