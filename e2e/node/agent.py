"""The node agent: schedules every pod onto this one node and runs it as the kubelet would.

It reads and writes the store directly (it is part of the cluster process), reports pod
status through the status subresource, and finishes a pod's graceful deletion once its
containers have stopped, releasing the pod's address.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.apiserver.errors import ApiError
from e2e.apiserver.store import Event, Store, now_iso
from e2e.ipam import AddressPool

from . import podspec
from .container import ContainerRunner
from .podspec import ConfigError, Image, PodContext

log = logging.getLogger(__name__)


class NodeAgent:
    def __init__(self, store: Store, name: str, pods: AddressPool, state_dir: Path,
                 images: dict[str, Image], podnet: Path, api_host: str, api_port: int,
                 ca: Path, tokens: dict[str, str], backoff_base: float = 10.0) -> None:
        self.store, self.name, self.pool = store, name, pods
        self.state_dir, self.images, self.podnet = state_dir, images, podnet
        self.api_host, self.api_port, self.ca, self.tokens = api_host, api_port, ca, tokens
        self.backoff_base = backoff_base
        self.runners: dict[tuple[str, str], PodRunner] = {}
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._pods = store.resource("", "v1", "pods")

    def flow_log(self, ip: str) -> Path:
        return self.state_dir / "flows" / f"{ip}.log"

    async def run(self) -> None:
        (self.state_dir / "flows").mkdir(parents=True, exist_ok=True)
        self._register_node()
        self.store.listeners.append(self._on_event)
        for pod in self.store.list(self._pods, None):
            self._queue.put_nowait((pod["metadata"]["namespace"], pod["metadata"]["name"]))
        while True:
            key = await self._queue.get()
            try:
                self._sync(key)
            except ApiError as e:
                log.warning("pod %s/%s: %s", *key, e)

    def _on_event(self, res: Any, event: Event) -> None:
        if res.key == self._pods.key:
            meta = event.obj["metadata"]
            self._queue.put_nowait((meta["namespace"], meta["name"]))

    def _register_node(self) -> None:
        nodes = self.store.resource("", "v1", "nodes")
        with contextlib.suppress(ApiError):
            self.store.create(nodes, None, {"metadata": {
                "name": self.name, "labels": {"kubernetes.io/hostname": self.name,
                                              "kubernetes.io/os": "linux"}}})
        self.store.patch(nodes, None, self.name, {"status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastHeartbeatTime": now_iso()}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": self.name}],
            "capacity": {"cpu": str(os.cpu_count()), "pods": "110"},
            "allocatable": {"cpu": str(os.cpu_count()), "pods": "110"}}},
            "application/merge-patch+json", "status")

    def _sync(self, key: tuple[str, str]) -> None:
        namespace, name = key
        try:
            pod = self.store.get(self._pods, namespace, name)
        except ApiError:
            runner = self.runners.pop(key, None)
            if runner is not None:  # removed without a graceful deletion: stop at once
                asyncio.ensure_future(runner.terminate(0, finish=False))
            return
        if not pod["spec"].get("nodeName"):
            self.store.patch(self._pods, namespace, name, {"spec": {"nodeName": self.name}},
                             "application/merge-patch+json")
            return  # the binding's own event brings the pod back here
        if pod["spec"]["nodeName"] != self.name:
            return
        runner = self.runners.get(key)
        if runner is None and not pod["metadata"].get("deletionTimestamp"):
            runner = PodRunner(self, pod)
            self.runners[key] = runner
            runner.task = asyncio.create_task(runner.run())
        if pod["metadata"].get("deletionTimestamp"):
            grace = float(pod["metadata"].get("deletionGracePeriodSeconds", 30))
            if runner is None:
                self._finish(namespace, name, None)
            elif not runner.terminating:
                asyncio.ensure_future(runner.terminate(grace, finish=True))

    def _finish(self, namespace: str, name: str, ip: str | None) -> None:
        self.runners.pop((namespace, name), None)
        with contextlib.suppress(ApiError):
            self.store.delete(self._pods, namespace, name, grace_seconds=0)
        if ip:
            self.pool.release(ip)

    def service_account_dir(self, pod: dict[str, Any], folder: Path) -> Path:
        """token, ca.crt and namespace, as a projected service account volume holds them."""
        namespace = pod["metadata"]["namespace"]
        account = pod["spec"].get("serviceAccountName", "default")
        token = secrets.token_urlsafe(32)
        self.tokens[token] = f"system:serviceaccount:{namespace}:{account}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "token").write_text(token)
        (folder / "namespace").write_text(namespace)
        shutil.copy(self.ca, folder / "ca.crt")
        return folder

    async def stop(self) -> None:
        """Cluster shutdown: every pod stops within its grace period (at most 10 seconds)."""
        runners = list(self.runners.values())
        await asyncio.gather(*(r.terminate(min(r.grace, 10.0), finish=False) for r in runners),
                             return_exceptions=True)


class PodRunner:
    def __init__(self, agent: NodeAgent, pod: dict[str, Any]) -> None:
        self.agent, self.pod = agent, pod
        meta = pod["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = agent.state_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        self.ip: str | None = None
        self.containers: list[ContainerRunner] = []
        self.task: asyncio.Task[None] | None = None
        self.terminating = False
        self._tasks: list[asyncio.Task[None]] = []
        self._last_status: dict[str, Any] | None = None
        self._started = now_iso()

    async def run(self) -> None:
        self.ip = self.agent.pool.allocate()
        with open(self.agent.state_dir / "pods.jsonl", "a") as record:  # who had which address
            meta = self.pod["metadata"]
            ports = {p["name"]: p["containerPort"] for c in self.pod["spec"].get("containers") or []
                     for p in c.get("ports") or [] if p.get("name")}
            record.write(json.dumps({"ip": self.ip, "namespace": self.namespace, "name": self.name,
                                     "labels": meta.get("labels") or {}, "ports": ports}) + "\n")
        self._report()
        volumes = await self._volumes()
        if volumes is None:
            return
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for spec in self.pod["spec"].get("containers") or []:
            runner = ContainerRunner(
                spec, policy, self.ip, self.agent.images.get, self._builder(spec, volumes),
                self.agent.podnet, self.agent.flow_log(self.ip), self.dir / f"{spec['name']}.log",
                self._report, grace_seconds=self.grace, backoff_base=self.agent.backoff_base)
            self.containers.append(runner)
        self._tasks = [asyncio.create_task(c.run()) for c in self.containers]
        self._report()
        for result in await asyncio.gather(*self._tasks, return_exceptions=True):
            if isinstance(result, Exception):
                log.error("pod %s/%s: container runner failed", self.namespace, self.name,
                          exc_info=result)
        self._report()

    async def _volumes(self) -> dict[str, str] | None:
        """Prepare every volume, retrying while a Secret or claim is missing (as kubelet does)."""
        while not self.terminating:
            try:
                return self._prepare_volumes()
            except ConfigError as e:
                self._report(waiting=(e.reason, str(e)))
                await asyncio.sleep(2)
        return None

    def _prepare_volumes(self) -> dict[str, str]:
        out: dict[str, str] = {}
        store = self.agent.store
        for volume in self.pod["spec"].get("volumes") or []:
            name = volume["name"]
            folder = self.dir / "volumes" / name
            if "emptyDir" in volume:
                folder.mkdir(parents=True, exist_ok=True)
            elif "hostPath" in volume:
                path = Path(volume["hostPath"]["path"])
                if volume["hostPath"].get("type") == "Directory" and not path.is_dir():
                    raise ConfigError("FailedMount", f"hostPath {path} is not a directory")
                folder = path
            elif "secret" in volume or "configMap" in volume:
                kind = "secret" if "secret" in volume else "configMap"
                ref = volume[kind]
                plural = "secrets" if kind == "secret" else "configmaps"
                try:
                    obj = store.get(store.resource("", "v1", plural), self.namespace,
                                    ref.get("secretName") or ref.get("name"))
                except ApiError:
                    if ref.get("optional"):
                        obj = {}
                    else:
                        raise ConfigError("FailedMount", f"{kind} for volume {name} not found") from None
                folder.mkdir(parents=True, exist_ok=True)
                for key, value in (obj.get("data") or {}).items():
                    data = base64.b64decode(value) if kind == "secret" else value.encode()
                    (folder / key).write_bytes(data)
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                try:
                    store.get(store.resource("", "v1", "persistentvolumeclaims"), self.namespace, claim)
                except ApiError:
                    raise ConfigError("FailedMount", f'persistentvolumeclaim "{claim}" not found') from None
                folder = self.agent.state_dir / "volumes" / f"{self.namespace}_{claim}"
                folder.mkdir(parents=True, exist_ok=True)
            else:
                raise ConfigError("FailedMount", f"volume {name}: unsupported type")
            out[name] = str(folder)
        return out

    def _builder(self, container: dict[str, Any], volumes: dict[str, str]) -> Callable[[Image], Any]:
        def build(image: Image) -> podspec.ProcessSpec:
            store = self.agent.store
            ns = self.namespace

            def data(plural: str) -> dict[str, dict[str, str]]:
                objs = store.list(store.resource("", "v1", plural), ns)
                return {o["metadata"]["name"]: o.get("data") or {} for o in objs}

            account = None
            with contextlib.suppress(ApiError):
                account = store.get(store.resource("", "v1", "serviceaccounts"), ns,
                                    self.pod["spec"].get("serviceAccountName", "default"))
            sa_dir = None
            if podspec.automounts_token(self.pod, account):
                sa_dir = str(self.agent.service_account_dir(self.pod, self.dir / "serviceaccount"))
            hosts = self.dir / "hosts"
            hosts.write_text(podspec.hosts_text(self.ip or "", self.name, self.agent.api_host))
            ctx = PodContext(pod_ip=self.ip or "", node_name=self.agent.name, host_ip="127.0.0.1",
                             api_host=self.agent.api_host, api_port=self.agent.api_port,
                             secrets=data("secrets"), config_maps=data("configmaps"),
                             volume_dirs=volumes, service_account_dir=sa_dir,
                             hosts_file=str(hosts))
            return podspec.container_process(self.pod, container, image, ctx)
        return build

    def status(self, waiting: tuple[str, str] | None = None) -> dict[str, Any]:
        statuses = [c.status() for c in self.containers]
        if waiting is not None and not statuses:
            statuses = [{"name": c["name"], "ready": False, "restartCount": 0,
                         "state": {"waiting": {"reason": waiting[0], "message": waiting[1]}}}
                        for c in self.pod["spec"].get("containers") or []]
        ready = bool(self.containers) and all(c.ready for c in self.containers)
        running = any("running" in c.state for c in self.containers)
        finished = bool(self.containers) and all(c.done for c in self.containers)
        phase = "Running" if running else "Pending"
        if finished:
            failed = any(c.state.get("terminated", {}).get("exitCode") for c in self.containers)
            phase = "Failed" if failed else "Succeeded"

        def condition(kind: str, ok: bool) -> dict[str, Any]:
            return {"type": kind, "status": "True" if ok else "False"}
        return {
            "phase": phase, "podIP": self.ip, "podIPs": [{"ip": self.ip}] if self.ip else [],
            "hostIP": "127.0.0.1", "startTime": self._started, "qosClass": "BestEffort",
            "conditions": [condition("PodScheduled", True), condition("Initialized", True),
                           condition("ContainersReady", ready), condition("Ready", ready)],
            "containerStatuses": statuses,
        }

    def _report(self, waiting: tuple[str, str] | None = None) -> None:
        status = self.status(waiting)
        if status == self._last_status or self.terminating:
            return
        self._last_status = status
        store = self.agent.store
        with contextlib.suppress(ApiError):
            store.patch(store.resource("", "v1", "pods"), self.namespace, self.name,
                        {"status": {**status, "conditions": status["conditions"]}},
                        "application/merge-patch+json", "status")

    async def terminate(self, grace: float, finish: bool) -> None:
        if self.terminating:
            return
        self.terminating = True
        await asyncio.gather(*(c.stop(grace) for c in self.containers), return_exceptions=True)
        for task in self._tasks + ([self.task] if self.task else []):
            task.cancel()
        if finish:
            self.agent._finish(self.namespace, self.name, self.ip)
        elif self.ip:
            self.agent.pool.release(self.ip)
