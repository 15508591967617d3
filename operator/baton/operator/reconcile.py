"""One level-based reconcile pass of one PDDeployment.

Read everything, compare with what the spec asks for, act on the difference, write status if
it changed. Nothing is kept in memory between passes.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

import kopf

from baton.api import SpecProblem, parse_spec
from baton.api.models import PDDeploymentSpec

from . import admission, labels, status
from .actuation import EventSink, PodActuator, event_sink
from .config import OperatorConfig
from .desired import Desired, controller_target, desired_state
from .kube import ApiError, KubeApi
from .manifests import names, policy, router, workers
from .planning import (
    POOL_ROLES,
    PodView,
    format_time,
    leaving_pods,
    migration_peers,
    plan_pods,
)
from .worker_client import WorkerClient

log = logging.getLogger(__name__)

def contains(actual: Any, wanted: Any) -> bool:
    """Whether `actual` already holds everything in `wanted` (the server may add more)."""
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(contains(actual.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return (isinstance(actual, list) and len(actual) == len(wanted)
                and all(contains(a, w) for a, w in zip(actual, wanted, strict=True)))
    return actual == wanted or str(actual) == str(wanted)


def _drift_patch(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any] | None:
    patch: dict[str, Any] = {}
    wanted_labels = desired["metadata"].get("labels", {})
    if not contains(current.get("metadata", {}).get("labels") or {}, wanted_labels):
        patch["metadata"] = {"labels": wanted_labels}
    for key, value in desired.items():
        if key in ("apiVersion", "kind", "metadata", "data"):
            continue  # data: the Secret's token is generated once and never rewritten
        if not contains(current.get(key), value):
            patch[key] = value
    return patch or None


class Reconciler:
    def __init__(self, api: KubeApi, config: OperatorConfig,
                 now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        self.api = api
        self.config = config
        self.now = now

    async def reconcile(self, namespace: str, name: str) -> float:
        """Run one pass; return the seconds to wait before the next one."""
        owner = await self.api.get("PDDeployment", namespace, name)
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            return self.config.resync_seconds
        emit = event_sink(owner)
        previous = owner.get("status") or {}
        generation = owner["metadata"].get("generation")
        try:
            spec = parse_spec(owner.get("spec"))
            admission.check_spec(spec, self.config.allowed_host_paths)
        except SpecProblem as problem:
            new = status.invalid_spec_status(previous, generation, str(problem), self._stamp())
            if await self._write_status(namespace, name, previous, new):
                emit("InvalidSpec", str(problem), True)
            return self.config.resync_seconds

        desired = desired_state(spec, controller_target(previous))
        try:
            token = await self._ensure_secret(owner, emit)
            await self._ensure_children(owner, spec, emit)
            async with WorkerClient(token, self.config.worker_port, self.config.worker_timeout) as wc:
                busy = await self._reconcile_pods(owner, spec, desired, wc, emit)
        except ApiError as error:
            # Quota, admission, a bad quantity: the user must see it on the resource itself.
            new = status.error_status(previous, generation, str(error), self._stamp())
            if await self._write_status(namespace, name, previous, new):
                emit("ReconcileError", str(error), True)
            return self.config.busy_seconds * 5

        pods = [PodView.of(p) for p in await self._worker_pods(namespace, name)]
        plan = plan_pods(spec, pods, desired)
        new = status.compute_status(previous, generation, spec, pods, plan,
                                    await self._router_ready(namespace, name), self._stamp(),
                                    deployment=name, desired=desired)
        await self._write_status(namespace, name, previous, new)
        return self.config.busy_seconds if busy or plan.in_flight else self.config.resync_seconds

    def _stamp(self) -> str:
        return format_time(self.now())

    async def _worker_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return await self.api.list("Pod", namespace, labels.selector(name, labels.WORKER))

    async def _router_ready(self, namespace: str, name: str) -> int:
        found = await self.api.get("Deployment", namespace, names.router_name(name))
        return int(((found or {}).get("status") or {}).get("readyReplicas") or 0)

    async def _write_status(self, namespace: str, name: str, previous: dict[str, Any],
                            new: dict[str, Any]) -> bool:
        if not status.changed(previous, new):
            return False
        await self.api.patch("PDDeployment", namespace, name, {"status": new}, sub="status")
        return True

    async def _create(self, owner: dict[str, Any], body: dict[str, Any], emit: EventSink) -> None:
        kopf.adopt(body, owner=owner)
        await self.api.create(owner["metadata"]["namespace"], body)
        emit("Created", f"created {body['kind']} {body['metadata']['name']}", False)

    async def _ensure_secret(self, owner: dict[str, Any], emit: EventSink) -> str | None:
        namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
        found = await self.api.get("Secret", namespace, names.secret_name(name))
        if found is None:
            found = policy.internal_token_secret(name)
            await self._create(owner, found, emit)
        encoded = (found.get("data") or {}).get(workers.TOKEN_KEY)
        return base64.b64decode(encoded).decode() if encoded else None

    async def _ensure_children(self, owner: dict[str, Any], spec: PDDeploymentSpec,
                               emit: EventSink) -> None:
        namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
        desired = [
            *(router.pool_service(name, role) for role in POOL_ROLES),
            *router.router_rbac(name),
            router.router_deployment(name, spec),
            router.router_service(name, spec),
            policy.worker_disruption_budget(name),
            policy.worker_network_policy(name, self.config.policy_peers),
        ]
        if await self.api.has_api("monitoring.coreos.com/v1"):
            desired.append(policy.service_monitor(name, self.config.service_monitor_labels))
        for body in desired:
            current = await self.api.get(body["kind"], namespace, body["metadata"]["name"])
            if current is None:
                await self._create(owner, body, emit)
                continue
            patch = _drift_patch(current, body)
            if patch is not None:
                await self.api.patch(body["kind"], namespace, body["metadata"]["name"], patch)
                emit("Updated", f"updated {body['kind']} {body['metadata']['name']} "
                     f"({', '.join(sorted(patch))} drifted)", False)

    async def _reconcile_pods(self, owner: dict[str, Any], spec: PDDeploymentSpec,
                              desired: Desired, wc: WorkerClient, emit: EventSink) -> bool:
        namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
        pods = [PodView.of(p) for p in await self._worker_pods(namespace, name)]
        plan = plan_pods(spec, pods, desired)
        peers = migration_peers(pods, leaving_pods(plan), wc.port)
        act = PodActuator(self.api, wc, namespace, spec.drain_timeout_seconds, emit, self.now, peers)
        for pod in plan.delete_now:
            await act.delete(pod, f"pod phase {pod.phase}")
        for role, count in plan.create.items():
            for _ in range(count):
                body = workers.worker_pod(name, names.new_worker_pod_name(name), role, spec)
                await self._create(owner, body, emit)
        for pod, target in plan.convert:
            await act.convert(pod, target, workers.pool_of(spec, target).tensor_parallel_size)
        for pod in plan.start_removal:
            await act.start_removal(pod)
        for pod in plan.removing:
            await act.continue_removal(pod)
        return plan.in_flight
