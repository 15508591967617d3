"""A real Prometheus for tests: /usr/bin/prometheus on a free loopback port, scraping every
second the targets the test names, with its config and storage in a temporary folder."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

PROMETHEUS = "/usr/bin/prometheus"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def config_text(targets: list[str], interval: str = "1s",
                labels: dict[str, dict[str, str]] | None = None) -> str:
    """A scrape config for `targets` ("host:port"), each with its target `labels` if given
    (as Kubernetes discovery would give namespace and pod). JSON is valid YAML."""
    groups = [{"targets": [t], "labels": (labels or {}).get(t, {})} for t in targets]
    return json.dumps({"global": {"scrape_interval": interval, "evaluation_interval": interval},
                       "scrape_configs": [{"job_name": "baton", "static_configs": groups}]})


@dataclass
class Prometheus:
    url: str
    log: Path

    def query(self, expr: str) -> list[dict]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        response.raise_for_status()
        body = response.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for_targets(self, count: int, deadline_s: float = 20.0) -> None:
        """Until `count` targets were scraped successfully at least once."""
        stop = time.monotonic() + deadline_s
        while time.monotonic() < stop:
            if sum(1 for r in self.query("up == 1")) >= count:
                return
            time.sleep(0.2)
        raise AssertionError(f"Prometheus saw fewer than {count} targets up; log:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running_prometheus(targets: list[str], folder: Path, interval: str = "1s",
                       deadline_s: float = 30.0,
                       labels: dict[str, dict[str, str]] | None = None) -> Iterator[Prometheus]:
    if not shutil.which(PROMETHEUS):
        pytest.skip(f"{PROMETHEUS} is not installed (Debian package prometheus; .ci/run installs it)")
    config = folder / "prometheus.yml"
    config.write_text(config_text(targets, interval, labels))
    port = free_port()
    log = folder / "prometheus.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=output, stderr=subprocess.STDOUT)
    server = Prometheus(f"http://127.0.0.1:{port}", log)
    try:
        stop = time.monotonic() + deadline_s
        while True:
            if process.poll() is not None:
                raise AssertionError(f"Prometheus exited with {process.returncode}:\n{server.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/-/ready", timeout=1).status_code == 200:
                    break
            if time.monotonic() > stop:
                raise AssertionError(f"Prometheus not ready after {deadline_s}s:\n{server.tail()}")
            time.sleep(0.1)
        yield server
    finally:
        process.kill()
        process.wait(10)
