"""Deleting a PDDeployment: drain its workers first, then remove everything it owns.

The operator's finalizer holds the PDDeployment while this runs, so neither Kubernetes'
garbage collector nor anyone else removes the pods under running streams. Each pass labels
every worker `draining` (routers stop sending it work), asks it to drain (no peers: the
whole fleet goes, so sequences finish where they are), and deletes the pods that drained or
whose `drainTimeoutSeconds` passed. The router stays up until the last worker is gone, so
the streams in flight reach their clients through it.
"""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Callable
from typing import Any

from baton.api import SpecProblem, parse_spec
from baton.api.models import PDDeploymentSpec

from . import labels
from .actuation import PodActuator, event_sink
from .config import OperatorConfig
from .kube import KubeApi
from .manifests import names, workers
from .planning import PodView
from .worker_client import WorkerClient

# Kinds deleted with the PDDeployment (ownerReferences do it too on a real cluster).
CHILD_KINDS = ("Pod", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
               "ServiceMonitor", "RoleBinding", "Role", "ServiceAccount", "Secret")
DEFAULT_DRAIN_TIMEOUT = PDDeploymentSpec.model_fields["drain_timeout_seconds"].default


def drain_timeout(raw_spec: dict[str, Any] | None) -> float:
    """The spec's drainTimeoutSeconds; the default when the spec is not valid (pure)."""
    try:
        return float(parse_spec(raw_spec).drain_timeout_seconds)
    except SpecProblem:
        return float(DEFAULT_DRAIN_TIMEOUT)


class Teardown:
    def __init__(self, api: KubeApi, config: OperatorConfig,
                 now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        self.api = api
        self.config = config
        self.now = now

    async def _worker_pods(self, namespace: str, name: str) -> list[PodView]:
        found = await self.api.list("Pod", namespace, labels.selector(name, labels.WORKER))
        return [PodView.of(p) for p in found]

    async def _token(self, namespace: str, name: str) -> str | None:
        found = await self.api.get("Secret", namespace, names.secret_name(name))
        encoded = ((found or {}).get("data") or {}).get(workers.TOKEN_KEY)
        return base64.b64decode(encoded).decode() if encoded else None

    async def drain_workers(self, owner: dict[str, Any]) -> int:
        """One pass; returns the worker pods still draining (0: all gone or going)."""
        namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
        pods = [p for p in await self._worker_pods(namespace, name) if not p.deleting]
        if not pods:
            return 0
        token = await self._token(namespace, name)
        config = self.config
        async with WorkerClient(token, config.worker_port, config.worker_timeout) as client:
            act = PodActuator(self.api, client, namespace, drain_timeout(owner.get("spec")),
                              event_sink(owner), self.now, peers=[])
            for pod in pods:
                if pod.dead:
                    await act.delete(pod, "deployment deleted")
                elif pod.state == labels.STATE_ACTIVE:
                    await act.start_removal(pod)
                else:
                    await act.continue_removal(pod)
        return sum(1 for p in await self._worker_pods(namespace, name) if not p.deleting)

    async def delete_children(self, owner: dict[str, Any]) -> int:
        """Remove everything labelled as belonging to the PDDeployment and owned by it."""
        namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
        uid = owner["metadata"].get("uid")
        removed = 0
        for kind in CHILD_KINDS:
            if kind == "ServiceMonitor" and not await self.api.has_api("monitoring.coreos.com/v1"):
                continue
            for child in await self.api.list(kind, namespace, {labels.DEPLOYMENT: name}):
                refs = child["metadata"].get("ownerReferences") or []
                if uid and refs and not any(r.get("uid") == uid for r in refs):
                    continue  # same name, another owner: not ours to delete
                await self.api.delete(kind, namespace, child["metadata"]["name"])
                removed += 1
        return removed
