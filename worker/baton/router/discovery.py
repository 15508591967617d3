"""Where the workers are: a static list, or worker pods watched in Kubernetes.

Kubernetes: list then watch the namespace's pods with the operator's labels
(docs/contracts.md); a pod is a member while it is Ready, has an IP and is not being
deleted. Its role and state labels travel with it, so a `draining` label stops new work
before the worker's own state poll says so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import httpx

from baton.router.pool import Membership, WorkerPool

log = logging.getLogger(__name__)

DEPLOYMENT_LABEL = "baton.dev/deployment"
ROLE_LABEL = "baton.dev/role"
STATE_LABEL = "baton.dev/state"
COMPONENT_LABEL = "app.kubernetes.io/component"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Discovery(Protocol):
    async def run(self, pool: WorkerPool) -> None: ...


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


class StaticDiscovery:
    def __init__(self, urls: list[str]):
        self.urls = [normalize_url(u) for u in urls if u.strip()]

    async def run(self, pool: WorkerPool) -> None:
        pool.set_members([Membership(u) for u in self.urls])


def member_from_pod(pod: dict[str, Any], deployment: str, worker_port: int) -> Membership | None:
    """A worker pod that may take work, or None (not ours, not ready, going away)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(DEPLOYMENT_LABEL) != deployment or labels.get(COMPONENT_LABEL, "worker") != "worker":
        return None
    if meta.get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    if not ip or not ready:
        return None
    return Membership(url=f"http://{ip}:{worker_port}", role=labels.get(ROLE_LABEL),
                      state=labels.get(STATE_LABEL, "active"))


def members_from_pods(pods: dict[str, dict], deployment: str, worker_port: int) -> list[Membership]:
    found = (member_from_pod(p, deployment, worker_port) for p in pods.values())
    return sorted((m for m in found if m is not None), key=lambda m: m.url)


class KubernetesDiscovery:
    def __init__(self, deployment: str, namespace: str | None = None, api_url: str | None = None,
                 token: str | None = None, verify: bool | str = True, worker_port: int = 8100,
                 reconnect_s: float = 1.0, watch_timeout_s: int = 300):
        self.deployment = deployment
        self.namespace = namespace or os.environ.get("POD_NAMESPACE") or _file(SERVICE_ACCOUNT / "namespace") or "default"
        if api_url is None:  # in-cluster
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError("not inside a cluster: pass the API server URL (--kube-api)")
            api_url = f"https://{host}:{port}"
            token = token or _file(SERVICE_ACCOUNT / "token")
            ca = SERVICE_ACCOUNT / "ca.crt"
            verify = str(ca) if ca.exists() else verify
        self.api_url = api_url.rstrip("/")
        self.token, self.verify = token, verify
        self.worker_port = worker_port
        self.reconnect_s = reconnect_s
        self.watch_timeout_s = watch_timeout_s
        self.pods: dict[str, dict] = {}

    @property
    def selector(self) -> str:
        return f"{DEPLOYMENT_LABEL}={self.deployment},{COMPONENT_LABEL}=worker"

    def _publish(self, pool: WorkerPool) -> None:
        pool.set_members(members_from_pods(self.pods, self.deployment, self.worker_port))

    async def run(self, pool: WorkerPool) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        path = f"{self.api_url}/api/v1/namespaces/{self.namespace}/pods"
        timeout = httpx.Timeout(10.0, read=self.watch_timeout_s + 30)
        async with httpx.AsyncClient(headers=headers, verify=self.verify, timeout=timeout) as http:
            while True:
                try:
                    version = await self._list(http, path, pool)
                    await self._watch(http, path, version, pool)
                except (httpx.HTTPError, ValueError) as e:
                    log.warning("pod watch interrupted (%s); listing again", e)
                await asyncio.sleep(self.reconnect_s)

    async def _list(self, http: httpx.AsyncClient, path: str, pool: WorkerPool) -> str | None:
        response = await http.get(path, params={"labelSelector": self.selector})
        response.raise_for_status()
        listing = response.json()
        self.pods = {p["metadata"]["name"]: p for p in listing.get("items") or []}
        self._publish(pool)
        return (listing.get("metadata") or {}).get("resourceVersion")

    async def _watch(self, http: httpx.AsyncClient, path: str, version: str | None, pool: WorkerPool) -> None:
        params = {"watch": "true", "labelSelector": self.selector, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self.watch_timeout_s)}
        if version:
            params["resourceVersion"] = version
        async with http.stream("GET", path, params=params) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # e.g. 410 Gone: our version is too old, list again
                    raise ValueError(f"watch error: {obj.get('message', obj)}")
                name = (obj.get("metadata") or {}).get("name")
                if not name or kind == "BOOKMARK":
                    continue
                if kind == "DELETED":
                    self.pods.pop(name, None)
                else:
                    self.pods[name] = obj
                self._publish(pool)


def _file(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
