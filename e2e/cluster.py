"""`python -m e2e.cluster up --kubeconfig PATH`: a Kubernetes cluster on this machine.

One process holds the API server (HTTPS on 127.0.0.1), the controllers (deployments,
endpoints, garbage collection), the node agent that runs pods as local processes, and a real
Prometheus; the operator is installed by real Helm from charts/baton and runs as a pod.
It stays up until Ctrl-C (or SIGTERM), then stops every pod and process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from e2e import helm, ipam
from e2e.apiserver.server import ApiServer
from e2e.apiserver.store import Store
from e2e.controllers import deployments, endpoints, garbage, jobs
from e2e.controllers.loop import run_controller
from e2e.kubeconfig import render
from e2e.monitoring import SERVICE_MONITOR_CRD, Prometheus, free_port
from e2e.node.agent import NodeAgent
from e2e.node.images import image_from
from e2e.tls import make_certificates, server_context

ROOT = Path(__file__).resolve().parents[1]
IMAGE_TAG = "0.1.0"
RELEASE, RELEASE_NAMESPACE = "baton", "baton-system"
NODE = "baton-e2e-node"
# Prometheus runs beside the cluster; the NetworkPolicy check treats it as the pod that
# kube-prometheus-stack would run: this namespace, these labels (the chart's defaults).
PROMETHEUS_NAMESPACE = "monitoring"
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}
log = logging.getLogger("e2e.cluster")


# The worker image is also held under a second tag, so a scenario can roll to a new image.
NEXT_TAG = f"{IMAGE_TAG}-next"


def images(worker_env: Path, operator_env: Path) -> dict[str, Any]:
    worker = ROOT / "worker" / "Dockerfile"
    return {
        f"baton-worker:{IMAGE_TAG}": image_from(f"baton-worker:{IMAGE_TAG}", worker_env, worker),
        f"baton-worker:{NEXT_TAG}": image_from(f"baton-worker:{NEXT_TAG}", worker_env, worker),
        f"baton-operator:{IMAGE_TAG}": image_from(f"baton-operator:{IMAGE_TAG}", operator_env,
                                                  ROOT / "operator" / "Dockerfile"),
    }


def allocate_cluster_ips(pool: ipam.AddressPool) -> tuple[Any, Any]:
    def on_create(res: Any, obj: dict[str, Any]) -> None:
        spec = obj.get("spec") or {}
        if res.kind == "Service" and spec.get("type", "ClusterIP") != "ExternalName" \
                and not spec.get("clusterIP"):
            spec["clusterIP"] = pool.allocate()
            spec["clusterIPs"] = [spec["clusterIP"]]

    def on_delete(res: Any, obj: dict[str, Any]) -> None:
        address = (obj.get("spec") or {}).get("clusterIP")
        if res.kind == "Service" and address and address != "None":
            pool.release(address)
    return on_create, on_delete


class Cluster:
    def __init__(self, state_dir: Path, kubeconfig: Path, block: int, operator: bool,
                 backoff: float, helm_values: dict[str, Any]) -> None:
        self.dir, self.kubeconfig, self.operator = state_dir, kubeconfig, operator
        self.helm_values = helm_values
        self.store = Store()
        self.admin_token = secrets.token_urlsafe(24)
        self.tokens = {self.admin_token: "kubernetes-admin"}
        self.api = ApiServer(self.store, self.tokens, state_dir / "requests.jsonl")
        self.block = block
        self.pods, services = ipam.cluster_pools(block)
        self.api_ip = services.allocate()  # the `kubernetes` Service: the API server, port 443
        hooks = allocate_cluster_ips(services)
        self.store.on_create.append(hooks[0])
        self.store.on_delete.append(hooks[1])
        self.prometheus = Prometheus(self.store, state_dir)
        self.backoff = backoff
        self.agent: NodeAgent | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.routers: dict[str, str] = {}

    async def start(self) -> dict[str, Any]:
        ca, crt, key = make_certificates(self.dir / "pki", ["127.0.0.1", self.api_ip])
        context = server_context(crt, key)
        port = await self.api.start("127.0.0.1", free_port("127.0.0.1"), context)
        await self.api.listen(self.api_ip, 443, context)
        self._kubernetes_service(port)
        server = f"https://127.0.0.1:{port}"
        self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        self.kubeconfig.write_text(render(server, ca, self.admin_token))
        crds = self.store.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        self.store.create(crds, None, SERVICE_MONITOR_CRD)  # as kube-prometheus-stack would
        namespaces = self.store.resource("", "v1", "namespaces")
        self.store.create(namespaces, None, {"metadata": {"name": PROMETHEUS_NAMESPACE}})
        self.agent = NodeAgent(self.store, NODE, self.pods, self.dir, images(
            ROOT / ".venv", ROOT / ".venv-operator"), ROOT / "e2e" / ".build" / "podnet.so",
            self.api_ip, 443, ca, self.tokens, backoff_base=self.backoff)
        await self.prometheus.start()
        watched_all = {("", "pods"), ("", "services"), ("apps", "deployments"), ("", "endpoints"),
                       ("monitoring.coreos.com", "servicemonitors")}
        self._tasks = [
            asyncio.create_task(self.agent.run()),
            asyncio.create_task(run_controller(self.store, "deployments", {("", "pods"), (
                "apps", "deployments")}, lambda: deployments.reconcile(self.store))),
            asyncio.create_task(run_controller(self.store, "jobs", {("", "pods"), (
                "batch", "jobs")}, lambda: jobs.reconcile(self.store))),
            asyncio.create_task(run_controller(self.store, "endpoints", {("", "pods"), (
                "", "services")}, lambda: endpoints.reconcile(self.store))),
            asyncio.create_task(run_controller(self.store, "garbage", set(),
                                               lambda: garbage.reconcile(self.store), resync=2.0)),
            asyncio.create_task(run_controller(self.store, "prometheus", watched_all,
                                               self.prometheus.reconcile, resync=5.0)),
            asyncio.create_task(run_controller(self.store, "routers", {("", "endpoints")},
                                               self._announce_routers, resync=10.0)),
        ]
        if self.operator:
            await asyncio.to_thread(helm.install, self.kubeconfig, RELEASE_NAMESPACE, RELEASE,
                                    self.helm_values)
        info = {"server": server, "kubeconfig": str(self.kubeconfig),
                "prometheus": self.prometheus.url, "state_dir": str(self.dir),
                "pod_ips": f"127.0.{32 * self.block}.1 - 127.0.{32 * self.block + 15}.254"}
        (self.dir / "cluster.json").write_text(json.dumps(info, indent=2))
        return info

    def _kubernetes_service(self, port: int) -> None:
        """default/kubernetes, as every cluster has it: in-cluster clients find the API here."""
        services = self.store.resource("", "v1", "services")
        self.store.create(services, "default", {"metadata": {"name": "kubernetes", "labels": {
            "component": "apiserver", "provider": "kubernetes"}}, "spec": {
            "clusterIP": self.api_ip, "ports": [{"name": "https", "port": 443, "targetPort": port}]}})
        self.store.create(self.store.resource("", "v1", "endpoints"), "default", {
            "metadata": {"name": "kubernetes"},
            "subsets": [{"addresses": [{"ip": "127.0.0.1"}], "ports": [{"name": "https", "port": port}]}]})

    def _announce_routers(self) -> None:
        """Print each router Service's address once its pod is ready (the URL people use)."""
        for ep in self.store.list(self.store.resource("", "v1", "endpoints"), None):
            if (ep["metadata"].get("labels") or {}).get("app.kubernetes.io/component") != "router":
                continue
            addresses = [f"http://{a['ip']}:{p['port']}" for s in ep.get("subsets") or []
                         for a in s.get("addresses") or [] for p in s.get("ports") or []]
            key = f"{ep['metadata']['namespace']}/{ep['metadata']['name']}"
            if addresses and self.routers.get(key) != addresses[0]:
                self.routers[key] = addresses[0]
                print(f"router {key}: {addresses[0]}/v1", flush=True)

    async def stop(self) -> None:
        if self.agent is not None:
            await self.agent.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.prometheus.stop()
        await self.api.stop()


async def up(args: argparse.Namespace) -> int:
    state = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="baton-e2e-", dir="/var/tmp"))
    state.mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {"operator": {"resyncSeconds": 10,
                                           "metricsNamespace": PROMETHEUS_NAMESPACE,
                                           "metricsPodLabels": PROMETHEUS_LABELS}}
    if args.allow_host_path:
        values["operator"]["allowedHostPaths"] = args.allow_host_path
    cluster = Cluster(state, Path(args.kubeconfig).resolve(), args.block, not args.no_operator,
                      args.backoff, values)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    try:
        info = await cluster.start()
        print(f"cluster up in {time.monotonic() - started:.1f}s", flush=True)
        for key, value in info.items():
            print(f"  {key}: {value}", flush=True)
        print(f"  try: kubectl --kubeconfig {info['kubeconfig']} apply -f crds/samples/minimal.yaml",
              flush=True)
        print("READY", flush=True)
        await stop.wait()
    finally:
        print("stopping: pods, Prometheus, API server", flush=True)
        await cluster.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("up", help="start the cluster and keep it up until Ctrl-C")
    run.add_argument("--kubeconfig", required=True, help="where to write the kubeconfig")
    run.add_argument("--state-dir", default=None, help="pods' folders and logs, outside /tmp (default: a new folder in /var/tmp)")
    run.add_argument("--block", type=int, default=1, help="address block 1..7: pods get "
                     "127.0.<32*block+0..15>.x, Services 127.0.<32*block+16..31>.x")
    run.add_argument("--allow-host-path", action="append", default=[],
                     help="passed to the chart's operator.allowedHostPaths (repeatable)")
    run.add_argument("--backoff", type=float, default=10.0,
                     help="container restart back-off base, seconds (the kubelet's is 10)")
    run.add_argument("--no-operator", action="store_true", help="do not install the chart")
    run.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(up(args))
    return 130


if __name__ == "__main__":
    sys.exit(main())
