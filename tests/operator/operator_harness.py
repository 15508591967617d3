"""Harness: kmock's Kubernetes emulator, a loopback fake worker, the real operator in-process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import kopf
from aiohttp import web

from baton.operator.config import OperatorConfig, configure
from baton.operator.handlers import register

NAMESPACE = "default"
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
RESOURCES = {
    "v1/pods": "Pod",
    "v1/services": "Service",
    "v1/secrets": "Secret",
    "v1/serviceaccounts": "ServiceAccount",
    "v1/events": "Event",
    "apps/v1/deployments": "Deployment",
    "rbac.authorization.k8s.io/v1/roles": "Role",
    "rbac.authorization.k8s.io/v1/rolebindings": "RoleBinding",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
    "networking.k8s.io/v1/networkpolicies": "NetworkPolicy",
    "baton.dev/v1alpha1/pddeployments": "PDDeployment",
    # Discovery only: kopf waits to see these two served before it starts watching.
    "v1/namespaces": "Namespace",
    "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
}
SERVICE_MONITORS = "monitoring.coreos.com/v1/servicemonitors"


def declare(emulator: Any, key: str, kind: str) -> None:
    subresources = {"status"} if kind in ("Pod", "PDDeployment", "Deployment") else set()
    emulator.resources[key] = emulator.ResourceInfo(
        kind=kind, singular=kind.lower(), namespaced=True, verbs=VERBS, subresources=subresources)


class FakeWorker:
    """The drain and role endpoints of docs/contracts.md on one port of several loopback
    addresses (pod IPs), shared by all pods; `received` tells which address got what."""

    HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None, Any]] = []
        self.received: list[tuple[str, str, str, Any]] = []  # (address, method, path, body)
        self.drain_finished = True  # GET /internal/drain answers "drained" when True
        self.role = "prefill"
        self.state = "active"
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _record(self, request: web.Request) -> Any:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.method, request.path, request.headers.get("Authorization"), body))
        address = request.transport.get_extra_info("sockname")[0] if request.transport else ""
        self.received.append((address, request.method, request.path, body))
        return body

    async def post_drain(self, request: web.Request) -> web.Response:
        await self._record(request)
        self.state = "draining"
        return web.json_response({"state": "draining"}, status=202)

    async def get_drain(self, request: web.Request) -> web.Response:
        await self._record(request)
        state = "drained" if self.drain_finished else "draining"
        return web.json_response({"state": state, "running": 0 if self.drain_finished else 3})

    async def post_role(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        self.role, self.state = body["role"], "active"
        return web.json_response({"role": self.role})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/internal/drain", self.post_drain)
        app.router.add_get("/internal/drain", self.get_drain)
        app.router.add_post("/internal/role", self.post_role)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.HOSTS[0], 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        for host in self.HOSTS[1:]:  # the same port on the other pod addresses
            await web.TCPSite(self._runner, host, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def paths(self, method: str) -> list[str]:
        return [path for m, path, _, _ in self.calls if m == method]


@contextlib.asynccontextmanager
async def running_operator(config: OperatorConfig) -> AsyncIterator[None]:
    """The real kopf operator with Baton's handlers, in-process on its own thread and loop.

    A loop of its own, as in production: kopf treats every task born after its start as its
    own and waits for them on exit, which would include the emulator's connection handlers.
    """
    registry = kopf.OperatorRegistry()
    register(registry, config)
    settings = kopf.OperatorSettings()
    configure(settings, config)
    settings.scanning.disabled = True  # kmock 0.8 cannot serve /api/v1/namespaces
    settings.watching.reconnect_backoff = 0.1
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            asyncio.run(kopf.operator(
                registry=registry, settings=settings, clusterwide=True, standalone=True,
                stop_flag=stop, ready_flag=ready))
        except BaseException as error:  # surfaced to the test below
            failure.append(error)
            ready.set()

    thread = threading.Thread(target=serve, name="kopf-operator", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 10), "operator did not start"
    try:
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
    assert not thread.is_alive(), "operator did not stop"
    assert not failure, failure


async def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    """Poll until `check()` returns something truthy (or an awaitable of it)."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while True:
        last = check()
        if isinstance(last, Awaitable):
            last = await last
        if last:
            return last
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}; last value {last!r}")
        await asyncio.sleep(0.05)


async def api(emulator: Any, method: str, path: str, body: Any = None) -> Any:
    """Talk to the emulator through HTTP, so watchers see the change."""
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
    async with emulator.request(method, path, data=None if body is None else json.dumps(body),
                                headers=headers) as response:
        assert response.status < 400, f"{method} {path}: {response.status} {await response.text()}"
        return await response.json()
