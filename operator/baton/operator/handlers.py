"""kopf handlers, kept thin: they wire kopf's events to the Reconciler and nothing more.

One daemon per PDDeployment runs reconcile passes; watch events on the PDDeployment and on
its worker pods only wake that daemon early. The wake-up events are the only in-memory
state, and losing them costs at most one resync period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import kopf

from baton.api import GROUP, PLURAL, VERSION

from . import labels
from .autoscaling.daemon import register_autoscaler
from .config import OperatorConfig, configure
from .kube import KubeApi
from .reconcile import Reconciler
from .teardown import Teardown

log = logging.getLogger(__name__)
SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class _Wakeups:
    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}

    def event(self, namespace: str, name: str) -> asyncio.Event:
        return self._events.setdefault((namespace, name), asyncio.Event())

    def poke(self, namespace: str | None, name: str | None) -> None:
        if namespace and name:
            self.event(namespace, name).set()

    def forget(self, namespace: str, name: str) -> None:
        self._events.pop((namespace, name), None)


class _Api:
    """The Kubernetes client, created once kopf has logged in."""

    def __init__(self) -> None:
        self.client: KubeApi | None = None

    def get(self) -> KubeApi:
        if self.client is None:
            raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=1)
        return self.client


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    wakeups = _Wakeups()
    api = _Api()

    register_autoscaler(registry, config, api.get)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings, config)

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        token_file = None
        info = config.connection
        if info is None:
            info = kopf.login_with_service_account(**kwargs)
            token_file = SERVICE_ACCOUNT_TOKEN if info is not None else None
        if info is None:
            info = kopf.login_with_kubeconfig(**kwargs)
        if info is not None and api.client is None:
            api.client = KubeApi(info, timeout=config.request_timeout, token_file=token_file)
        return info

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        if api.client is not None:
            await api.client.aclose()

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, id="reconciler",
                 cancellation_timeout=5.0)
    async def reconciler(namespace: str, name: str, stopped: kopf.DaemonStopped,
                         **_: Any) -> None:
        reconcile = Reconciler(api.get(), config)
        wake = wakeups.event(namespace, name)
        try:
            while not stopped:
                wake.clear()
                try:
                    delay = await reconcile.reconcile(namespace, name)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # Never a crash loop: log, back off, try again on the next pass.
                    log.exception("reconcile of %s/%s failed", namespace, name)
                    delay = config.busy_seconds * 5
                waiters = [asyncio.ensure_future(wake.wait()),
                           asyncio.ensure_future(stopped.wait())]
                try:
                    await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiter in waiters:
                        waiter.cancel()
        finally:
            wakeups.forget(namespace, name)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def deployment_changed(namespace: str, name: str, **_: Any) -> None:
        wakeups.poke(namespace, name)

    @kopf.on.event("", "v1", "pods", registry=registry,
                   labels={labels.DEPLOYMENT: kopf.PRESENT, labels.NAME: "baton"})
    async def worker_pod_changed(namespace: str, body: kopf.Body, **_: Any) -> None:
        wakeups.poke(namespace, body.metadata.labels.get(labels.DEPLOYMENT))

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry, id="children")
    async def deleted(body: kopf.Body, namespace: str, name: str, **_: Any) -> None:
        owner = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                 "metadata": dict(body.get("metadata", {})), "spec": dict(body.get("spec", {}))}
        teardown = Teardown(api.get(), config)
        draining = await teardown.drain_workers(owner)
        if draining:  # the finalizer holds the PDDeployment; kopf calls again after the delay
            raise kopf.TemporaryError(f"waiting for {draining} worker pod(s) to drain",
                                      delay=config.busy_seconds)
        removed = await teardown.delete_children(owner)
        kopf.info(body, reason="Deleted", message=f"removed {removed} child object(s)")
        with contextlib.suppress(Exception):
            wakeups.forget(namespace, name)
