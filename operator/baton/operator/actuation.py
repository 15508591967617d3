"""Pod-level actions with side effects: drain, remove, convert role.

Every step first records where it is in the pod's labels/annotations, then calls the worker,
so an operator that dies between the two repeats an idempotent call and moves on.

Conversion: active --(label draining, POST drain)--> draining --(GET drain: drained)-->
resharding --(POST role, with the target pool's tensor-parallel size)--> active with the new
role and size labels.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

import kopf

from . import labels
from .kube import KubeApi
from .planning import PodView, drain_expired, format_time, worker_url
from .worker_client import WorkerClient, WorkerUnreachable

log = logging.getLogger(__name__)

# (reason, message, warning?) -> posts a Kubernetes Event on the PDDeployment
EventSink = Callable[[str, str, bool], None]


def event_sink(owner: dict[str, Any]) -> EventSink:
    """Log and post Events on `owner`; posting is best effort, never a reason to stop."""
    def emit(reason: str, message: str, warning: bool) -> None:
        log.info("%s/%s %s: %s", owner["metadata"].get("namespace"), owner["metadata"]["name"],
                 reason, message)
        try:
            (kopf.warn if warning else kopf.info)(owner, reason=reason, message=message)
        except Exception:
            log.debug("event not posted", exc_info=True)
    return emit


class PodActuator:
    """peers: the decode workers a draining worker may migrate its sequences to (URLs)."""

    def __init__(self, api: KubeApi, workers: WorkerClient, namespace: str,
                 drain_timeout: float, emit: EventSink, now: Callable[[], dt.datetime],
                 peers: list[str] | None = None) -> None:
        self.api = api
        self.workers = workers
        self.namespace = namespace
        self.drain_timeout = drain_timeout
        self.emit = emit
        self.now = now
        self.peers = list(peers or [])

    def _peers_of(self, pod: PodView) -> list[str]:
        own = worker_url(pod.ip, self.workers.port) if pod.ip else None
        return [url for url in self.peers if url != own]

    async def _relabel(self, pod: PodView, new_labels: dict[str, str],
                       notes: dict[str, Any] | None = None) -> None:
        patch: dict[str, Any] = {"metadata": {"labels": new_labels}}
        if notes is not None:
            patch["metadata"]["annotations"] = notes
        await self.api.patch("Pod", self.namespace, pod.name, patch)

    async def delete(self, pod: PodView, why: str) -> None:
        await self.api.delete("Pod", self.namespace, pod.name)
        self.emit("DeletedPod", f"deleted worker pod {pod.name} ({pod.role}): {why}", False)

    async def _begin_drain(self, pod: PodView, converting_to: str | None) -> None:
        deadline = self.now() + dt.timedelta(seconds=self.drain_timeout)
        notes = {labels.DRAIN_DEADLINE: format_time(deadline)}
        if converting_to:
            notes[labels.CONVERSION_STARTED] = format_time(self.now())
        await self._relabel(pod, {labels.STATE: labels.STATE_DRAINING}, notes)
        if pod.ip:
            try:
                await self.workers.start_drain(pod.ip, self._peers_of(pod))
            except WorkerUnreachable as error:
                log.warning("drain request to %s failed, will poll: %s", pod.name, error)

    async def start_removal(self, pod: PodView) -> None:
        """Scale down: stop routing to the pod, ask it to drain; deletion comes later."""
        if not pod.ip or not pod.ready:
            await self.delete(pod, "scale down (not serving, nothing to drain)")
            return
        await self._begin_drain(pod, converting_to=None)
        self.emit("DrainingPod", f"draining worker pod {pod.name} ({pod.role}) before removal",
                  False)

    async def _drained(self, pod: PodView) -> tuple[bool, str]:
        if not pod.ip:
            return True, "no address"
        if drain_expired(pod, self.now()):
            return True, "drain deadline passed"
        try:
            state = await self.workers.drain_state(pod.ip)
        except WorkerUnreachable as error:
            log.info("drain poll of %s failed, will retry: %s", pod.name, error)
            return False, str(error)
        if state.drained:
            return True, "drained"
        # A worker that forgot (restarted) a drain is asked again; the call is idempotent.
        if state.state not in ("draining", "drained"):
            try:
                await self.workers.start_drain(pod.ip, self._peers_of(pod))
            except WorkerUnreachable:
                pass
        return False, f"{state.running} sequence(s) still running"

    async def continue_removal(self, pod: PodView) -> None:
        done, why = await self._drained(pod)
        if done:
            await self.delete(pod, f"scale down ({why})")

    async def convert(self, pod: PodView, target: str, tensor_parallel_size: int | None = None) -> None:
        """Advance one conversion by as many steps as are ready now. `tensor_parallel_size`:
        the target pool's ranks per worker, which the worker regroups onto."""
        if not pod.ip or pod.phase != "Running":
            # Not running yet: its process would boot with the old role; replace it instead.
            await self.delete(pod, f"conversion to {target} of a pod that is not running")
            return
        state = pod.state
        if state == labels.STATE_ACTIVE:
            await self._begin_drain(pod, converting_to=target)
            self.emit("ConversionStarted", f"worker pod {pod.name}: {pod.role} -> {target}, draining",
                      False)
            return
        if state == labels.STATE_DRAINING:
            done, _ = await self._drained(pod)
            if not done:
                return
            await self._relabel(pod, {labels.STATE: labels.STATE_RESHARDING})
            state = labels.STATE_RESHARDING
        if state == labels.STATE_RESHARDING:
            try:
                await self.workers.set_role(pod.ip, target, tensor_parallel_size)
            except WorkerUnreachable as error:
                log.warning("role switch of %s failed, will retry: %s", pod.name, error)
                return
            new_labels = {labels.ROLE: target, labels.STATE: labels.STATE_ACTIVE}
            if tensor_parallel_size is not None:  # a restart comes back at the new size
                new_labels[labels.TENSOR_PARALLEL] = str(tensor_parallel_size)
            await self._relabel(
                pod,
                new_labels,
                {labels.DRAIN_DEADLINE: None, labels.CONVERSION_STARTED: None},
            )
            self.emit("ConversionFinished", f"worker pod {pod.name}: {pod.role} -> {target}",
                      False)
