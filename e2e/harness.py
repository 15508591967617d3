"""What the scenarios use: the cluster as a subprocess, kubectl as people type it, waits.

The cluster runs as `python -m e2e.cluster up` in its own session; it dies with the test
process (PR_SET_PDEATHSIG) and is stopped with SIGTERM, then SIGKILL, at teardown.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from e2e.node.process import die_with_parent

ROOT = Path(__file__).resolve().parents[1]


class ClusterProcess:
    def __init__(self, block: int = 2, extra: list[str] | None = None) -> None:
        # Outside /tmp: pods mount their own /tmp (see e2e.node.process).
        self.dir = Path(tempfile.mkdtemp(prefix="baton-e2e-test-", dir="/var/tmp"))
        self.kubeconfig = self.dir / "kubeconfig"
        self.out = open(self.dir / "cluster.out", "w+b")  # noqa: SIM115 - lives with the process
        argv = [sys.executable, "-m", "e2e.cluster", "up", "--kubeconfig", str(self.kubeconfig),
                "--state-dir", str(self.dir / "state"), "--block", str(block), "--backoff", "2",
                "--log-level", "INFO", *(extra or [])]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent)
        self.info: dict[str, Any] = {}

    def output(self) -> str:
        return (self.dir / "cluster.out").read_text(errors="replace")

    def wait_ready(self, timeout: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "\nREADY\n" in "\n" + self.output():
                self.info = json.loads((self.dir / "state" / "cluster.json").read_text())
                return self.info
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"cluster did not come up:\n{self.output()[-5000:]}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.out.close()
        return self.proc.returncode

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        done = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {done.stderr}")
        return done.stdout + (done.stderr if not check else "")

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def pod_logs(self, pattern: str = "") -> str:
        """Container logs of pods whose folder name matches `pattern` (for failure messages)."""
        out = []
        for log in sorted((self.dir / "state" / "pods").glob("*/*.log")):
            if re.search(pattern, log.parent.name):
                out.append(f"--- {log.parent.name}/{log.name}\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (AssertionError, httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        found = re.match(rf"{re.escape(name)}(?:\{{([^}}]*)\}})?\s+(\S+)", line)
        if not found:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(found.group(2))
    return total


def pods(cluster: ClusterProcess, selector: str) -> list[dict[str, Any]]:
    return cluster.get("pods", "-l", selector)["items"]


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


def router_url(cluster: ClusterProcess, deployment: str) -> str:
    """The router Service's ready address (what a cluster's Service IP would forward to)."""
    subset = cluster.get("endpoints", deployment)["subsets"][0]
    return f"http://{subset['addresses'][0]['ip']}:{subset['ports'][0]['port']}"


def pod_folder(cluster: ClusterProcess, pod: dict[str, Any]) -> Path:
    meta = pod["metadata"]
    return cluster.dir / "state" / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"


def apply_and_wait_ready(cluster: ClusterProcess, manifest: dict[str, Any], pod_count: int = 3,
                         timeout: float = 420) -> str:
    """`kubectl apply` a PDDeployment and wait until its `pod_count` pods are Ready; on the
    deadline, fail with the pods, the resource and their logs. Returns its name."""
    name = manifest["metadata"]["name"]
    path = cluster.dir / f"{name}.json"
    path.write_text(json.dumps(manifest))
    cluster.kubectl("apply", "-f", str(path))

    def ready() -> bool:
        listed = pods(cluster, f"baton.dev/deployment={name}")
        return len(listed) == pod_count and all(map(is_ready, listed))
    try:
        wait_for(ready, timeout, f"the {name} deployment's pods to be Ready", every=3)
    except AssertionError:
        raise AssertionError(cluster.kubectl("get", "pods", "-o", "wide")
                             + cluster.kubectl("describe", "pdd", name)
                             + cluster.pod_logs(name)) from None
    return name
