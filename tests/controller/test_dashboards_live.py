"""System test: every query of the shipped Grafana dashboards returns data from a real
Prometheus scraping a real `baton up` (bundled model, 1 prefill + 1 decode, one thread each)
under real OpenAI-client traffic, with the controller running and its metrics scraped.

`baton up --autoscale` runs the controller inside the `baton up` process without a metrics
port, so the test runs the same Controller in-process (ScrapeSource + RayActuator over the
same workers) and serves its registry to Prometheus.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_fixture import free_port, running_prometheus

from baton.autoscaler.inputs import PolicyConfig
from baton.autoscaler.loop import Controller
from baton.autoscaler.metrics_scrape import ScrapeSource
from baton.autoscaler.policy import SizingPolicy
from baton.autoscaler.ray_actuator import RayActuator

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]
ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "charts" / "baton" / "dashboards").glob("*.json"))
UP_LINE = re.compile(r"Baton is up: (\S+)/v1\s+\(workers: ([^;]+);")
START_DEADLINE_S = 240


def dashboard_exprs() -> list[tuple[str, str]]:
    found = []

    def walk(node, name):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    found.append((name, value))
                else:
                    walk(value, name)
        elif isinstance(node, list):
            for item in node:
                walk(item, name)

    for path in DASHBOARDS:
        walk(json.loads(path.read_text()), path.name)
    return found


def start_baton_up(log_dir: Path) -> tuple[subprocess.Popen, str, list[str]]:
    command = [sys.executable, "-m", "baton.cli", "up", "--prefill", "1", "--decode", "1",
               "--port", "0", "--disagg-threshold", "0", "--log-dir", str(log_dir),
               "--worker-arg=--dtype=float32", "--worker-arg=--threads=1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    seen, deadline = [], time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            if process.poll() is not None:
                break
            continue
        seen.append(line)
        match = UP_LINE.search(line)
        if match:
            workers = [w.split("@", 1)[1].strip() for w in match.group(2).split(",")]
            return process, match.group(1), workers
    stop(process)
    raise AssertionError("baton up did not come up:\n" + "".join(seen[-40:]))


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)  # its own session: the workers go with it
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def send_traffic(router: str, requests: int = 6) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{router}/v1", api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    shared = "You are a careful assistant. " * 20  # a shared prefix: prefix-cache hits
    for i in range(requests):
        stream = client.chat.completions.create(
            model=model, stream=True, max_tokens=8, temperature=0,
            messages=[{"role": "system", "content": shared},
                      {"role": "user", "content": f"Count to {i + 3}."}])
        assert any(chunk.choices and chunk.choices[0].delta.content for chunk in stream)


def host_port(url: str) -> str:
    return urlparse(url).netloc


async def test_every_dashboard_query_returns_data(tmp_path):
    if not Path("/usr/bin/prometheus").exists():
        pytest.skip("/usr/bin/prometheus is not installed")
    (tmp_path / "logs").mkdir()  # baton up does not create --log-dir itself (yet)
    process, router, workers = await asyncio.to_thread(start_baton_up, tmp_path / "logs")
    registry, metrics_port = CollectorRegistry(), free_port()
    server, thread = start_http_server(metrics_port, addr="127.0.0.1", registry=registry)
    controller = Controller("local", ScrapeSource(workers), SizingPolicy(PolicyConfig()),
                            RayActuator(workers), period_s=1.0, registry=registry)
    stopped = asyncio.Event()
    loop_task = asyncio.create_task(controller.run(stopped))
    targets = [host_port(u) for u in [*workers, router]] + [f"127.0.0.1:{metrics_port}"]
    # the target labels Kubernetes discovery gives worker pods: namespace, pod NAME-w-xxxxxx
    pod_labels = {host_port(url): {"namespace": "local", "pod": f"local-w-{index:06x}"}
                  for index, url in enumerate(workers)}
    try:
        (tmp_path / "prom").mkdir()
        with running_prometheus(targets, tmp_path / "prom", labels=pod_labels) as prometheus:
            await asyncio.to_thread(prometheus.wait_for_targets, len(targets), 60)
            await asyncio.to_thread(send_traffic, router)
            await asyncio.sleep(4)  # a few more scrapes after the last request
            missing = []
            for name, expr in dashboard_exprs():
                # the controller here is Controller("local", ...): its deployment label
                query = expr.replace("$namespace", "local").replace("$deployment", "local")
                result = await asyncio.to_thread(prometheus.query, query)
                if not result:
                    missing.append(f"{name}: {query}")
            # what the variables list: the namespace, and the deployment from its pods' names
            found = await asyncio.to_thread(prometheus.query, "group by (namespace, pod) (baton_worker_role)")
            pods = {r["metric"].get("pod") for r in found if r["metric"].get("namespace") == "local"}
            deployments = {m.group(1) for p in pods if (m := re.fullmatch(r"(.+)-w-[0-9a-f]{6}", p or ""))}
    finally:
        stopped.set()
        await loop_task
        await controller.aclose()
        server.shutdown()
        thread.join(5)
        await asyncio.to_thread(stop, process)
    assert len(dashboard_exprs()) >= 20 and controller.periods > 0
    assert not missing, "queries without data:\n" + "\n".join(missing)
    assert deployments == {"local"}
