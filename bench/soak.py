"""Soak: mixed traffic with random disconnects and aborts against `baton up --prefill 1
--decode 1` for a while (10 minutes by default); do the workers give every KV block back,
and does memory stay flat?

    python bench/soak.py [--minutes 10] [--clients 16] [--out bench/results/soak.json]

Records every worker's free blocks at idle before and after, every process's RSS over
time (the servers, their Ray actors, Ray's own), the outcome counts, and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from machine_info import machine_record
from soak_traffic import run_clients

UP_LINE = re.compile(r"Baton is up: (http://\S+)/v1 .*workers: prefill@(http://\S+), decode@(http://\S+);")
WORKER_ARGS = ["--worker-arg=--dtype=float32", "--worker-arg=--num-kv-blocks=1024"]


def start_stack(log_dir: Path, token: str) -> tuple[subprocess.Popen, str, dict[str, str]]:
    out = log_dir / "baton-up.out"
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "up", "--prefill", "1", "--decode", "1",
                             "--port", "0", "--disagg-threshold", "48", "--log-dir", str(log_dir), *WORKER_ARGS],
                            stdout=open(out, "wb"), stderr=subprocess.STDOUT, start_new_session=True,  # noqa: SIM115
                            env={**os.environ, "BATON_INTERNAL_TOKEN": token})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = UP_LINE.search(out.read_text(errors="replace"))
        if match:
            return proc, match.group(1), {"prefill": match.group(2), "decode": match.group(3)}
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"baton up did not come up:\n{out.read_text(errors='replace')[-3000:]}")


def free_blocks(workers: dict[str, str], token: str) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {token}"}
    return {role: httpx.get(f"{url}/internal/state", headers=headers, timeout=10).json()["free_blocks"]
            for role, url in workers.items()}


def wait_idle(workers: dict[str, str], token: str, timeout_s: float = 60.0) -> dict[str, int]:
    """Free blocks once no sequence runs, waits or is reserved anywhere."""
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [httpx.get(f"{u}/internal/state", headers=headers, timeout=10).json() for u in workers.values()]
        if all(s["running"] == 0 and s["waiting"] == 0 and s["reservations"] == 0 for s in states):
            break
        time.sleep(0.5)
    return free_blocks(workers, token)


def label(p: psutil.Process) -> str:
    line = " ".join(p.cmdline())
    if "baton.router.main" in line:
        return "router"
    if "baton.server.main" in line:
        return "worker-" + line.split("--role ", 1)[1].split()[0]
    return p.name()


class RssSampler:
    """RSS of `baton up` and everything under it, every `every_s` seconds, on a thread."""

    def __init__(self, root_pid: int, every_s: float):
        self.root = psutil.Process(root_pid)
        self.every_s = every_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        rss = {}
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                rss[f"{label(p)}:{p.pid}"] = round(p.memory_info().rss / 2**20, 1)
            except psutil.Error:
                pass
        self.samples.append({"t_s": round(time.monotonic() - self._started, 1), "rss_mib": rss})

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)
        self.sample()


def rss_summary(samples: list[dict], warmup_s: float) -> dict:
    """Per process: RSS after warm-up, at the end, the most, and the growth in between."""
    steady = [s for s in samples if s["t_s"] >= warmup_s] or samples
    names = sorted({n for s in steady for n in s["rss_mib"]})
    out = {}
    for name in names:
        series = [s["rss_mib"][name] for s in steady if name in s["rss_mib"]]
        out[name] = {"after_warmup_mib": series[0], "end_mib": series[-1], "max_mib": max(series),
                     "growth_mib": round(series[-1] - series[0], 1)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16, help="concurrent client loops")
    parser.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of traffic before RSS counts as steady")
    parser.add_argument("--out", default="bench/results/soak.json")
    args = parser.parse_args()
    token = secrets.token_hex(16)
    log_dir = Path(tempfile.mkdtemp(prefix="baton-soak-"))
    machine = machine_record()
    proc, url, workers = start_stack(log_dir, token)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        idle_before = wait_idle(workers, token)
        print(f"stack up at {url}; free blocks at idle {idle_before}; {args.minutes:g} min of traffic", flush=True)
        started = time.monotonic()
        with RssSampler(proc.pid, args.rss_every) as rss:
            outcomes = asyncio.run(run_clients(url, model, args.clients, args.minutes * 60))
            traffic_s = time.monotonic() - started
            idle_after = wait_idle(workers, token)
        restarts = (log_dir / "baton-up.out").read_text(errors="replace").count(" restarted (pid")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    leaked = {role: idle_before[role] - idle_after[role] for role in idle_before}
    result = {
        "bench": "soak", "machine": machine, "minutes": args.minutes, "clients": args.clients,
        "traffic_seconds": round(traffic_s, 1), "requests": sum(v for k, v in outcomes.items() if ":" not in k),
        "outcomes": dict(outcomes), "free_blocks_idle_before": idle_before, "free_blocks_idle_after": idle_after,
        "leaked_blocks": leaked, "server_restarts": restarts,
        "rss": rss_summary(rss.samples, args.warmup), "rss_samples": rss.samples, "logs": str(log_dir),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    servers = {k: v for k, v in result["rss"].items() if k.startswith(("router", "worker"))}
    print(json.dumps({k: result[k] for k in ("requests", "outcomes", "leaked_blocks", "server_restarts")}, indent=1))
    print(json.dumps(servers, indent=1))
    return 0 if not any(leaked.values()) and not outcomes.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
