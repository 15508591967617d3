"""A real Prometheus, configured the way the Prometheus Operator would configure it.

Each ServiceMonitor endpoint becomes one scrape job whose targets (file_sd) are the ready
addresses of the selected Services' Endpoints on the named port, labelled namespace,
service, pod and endpoint as the Prometheus Operator labels them. The translation is pure;
`Prometheus` runs the binary and rewrites its files when the cluster changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import yaml

from e2e.apiserver.selectors import label_selector_matches
from e2e.apiserver.store import Store
from e2e.node.process import die_with_parent

SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"plural": "servicemonitors", "singular": "servicemonitor",
                       "kind": "ServiceMonitor", "listKind": "ServiceMonitorList",
                       "shortNames": ["smon"]},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                 "openAPIV3Schema": {"type": "object",
                                     "x-kubernetes-preserve-unknown-fields": True}}}]},
}


def job_name(monitor: dict[str, Any], index: int) -> str:
    meta = monitor["metadata"]
    return f"serviceMonitor/{meta['namespace']}/{meta['name']}/{index}"


def _namespaces(monitor: dict[str, Any]) -> list[str] | None:
    chooser = monitor.get("spec", {}).get("namespaceSelector") or {}
    if chooser.get("any"):
        return None
    return chooser.get("matchNames") or [monitor["metadata"]["namespace"]]


def targets(monitor: dict[str, Any], services: list[dict[str, Any]],
            endpoints: dict[tuple[str, str], dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """file_sd groups per endpoint entry of the monitor (pure)."""
    spec = monitor.get("spec") or {}
    allowed = _namespaces(monitor)
    chosen = [s for s in services
              if (allowed is None or s["metadata"]["namespace"] in allowed)
              and label_selector_matches(spec.get("selector"), s["metadata"].get("labels") or {})]
    out = []
    for entry in spec.get("endpoints") or []:
        groups = []
        for service in chosen:
            meta = service["metadata"]
            ep = endpoints.get((meta["namespace"], meta["name"]))
            for subset in (ep or {}).get("subsets") or []:
                ports = [p["port"] for p in subset.get("ports") or [] if p.get("name") == entry.get("port")]
                for port in ports:
                    for address in subset.get("addresses") or []:
                        ref = address.get("targetRef") or {}
                        groups.append({"targets": [f"{address['ip']}:{port}"], "labels": {
                            "namespace": meta["namespace"], "service": meta["name"],
                            "pod": ref.get("name", ""), "endpoint": entry.get("port", ""),
                            "job": meta["name"]}})
        out.append(groups)
    return out


def config(monitors: list[dict[str, Any]], sd_dir: Path, default_interval: str) -> dict[str, Any]:
    jobs = []
    for monitor in monitors:
        for index, entry in enumerate(monitor.get("spec", {}).get("endpoints") or []):
            name = job_name(monitor, index)
            jobs.append({"job_name": name,
                         "scrape_interval": entry.get("interval", default_interval),
                         "metrics_path": entry.get("path", "/metrics"),
                         "file_sd_configs": [{"files": [str(sd_dir / f"{_file(name)}.json")],
                                              "refresh_interval": "5s"}]})
    return {"global": {"scrape_interval": default_interval, "evaluation_interval": default_interval},
            "scrape_configs": jobs}


def _file(job: str) -> str:
    return job.replace("/", "_")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, store: Store, state_dir: Path, host: str = "127.0.0.1",
                 default_interval: str = "5s") -> None:
        self.store, self.dir, self.host = store, state_dir / "prometheus", host
        self.default_interval = default_interval
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self._config_text = ""
        self.scraped: set[str] = set()  # every target address ever handed to Prometheus

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        (self.dir / "sd").mkdir(parents=True, exist_ok=True)
        self._write()
        self.port = free_port(self.host)
        log = open(self.dir / "prometheus.log", "ab")  # noqa: SIM115 - kept for the process
        self.proc = await asyncio.create_subprocess_exec(
            "prometheus", f"--config.file={self.dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address={self.host}:{self.port}",
            "--web.enable-lifecycle", "--storage.tsdb.retention.time=1d",
            stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent)
        log.close()

    def _write(self) -> bool:
        store = self.store
        monitors = store.list(store.resource("monitoring.coreos.com", "v1", "servicemonitors"), None) \
            if any(r.group == "monitoring.coreos.com" for r in store.served()) else []
        services = store.list(store.resource("", "v1", "services"), None)
        endpoints = {(e["metadata"]["namespace"], e["metadata"]["name"]): e
                     for e in store.list(store.resource("", "v1", "endpoints"), None)}
        sd = self.dir / "sd"
        for monitor in monitors:
            for index, groups in enumerate(targets(monitor, services, endpoints)):
                path = sd / f"{_file(job_name(monitor, index))}.json"
                text = json.dumps(groups, sort_keys=True)
                self.scraped.update(t for g in groups for t in g["targets"])
                if not path.exists() or path.read_text() != text:
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(text)
                    os.replace(tmp, path)  # atomic: Prometheus never reads half a file
        text = yaml.safe_dump(config(monitors, sd, self.default_interval), sort_keys=False)
        if text == self._config_text:
            return False
        (self.dir / "prometheus.yml").write_text(text)
        self._config_text = text
        return True

    def reconcile(self) -> None:
        if self._write() and self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGHUP)  # new jobs: reload the configuration

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
