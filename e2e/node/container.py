"""One container's life on the node: pull (find the image), start, probe, restart, stop.

Restarts follow the pod's restartPolicy with the kubelet's back-off (doubling from
`backoff_base` up to five minutes, forgotten after ten minutes of running). Liveness and
startup failures kill the container; readiness only changes what the pod reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import probes
from .podspec import ConfigError, Image, ProcessSpec
from .process import ContainerProcess

log = logging.getLogger(__name__)
BACKOFF_MAX = 300.0
BACKOFF_RESET_AFTER = 600.0


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def should_restart(policy: str, exit_code: int) -> bool:
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


class ContainerRunner:
    def __init__(self, spec: dict[str, Any], restart_policy: str, pod_ip: str,
                 image: Callable[[str], Image | None], build: Callable[[Image], ProcessSpec],
                 podnet: Path, flow_log: Path, log_path: Path, changed: Callable[[], None],
                 grace_seconds: float, backoff_base: float = 10.0,
                 probe_tick: float = 0.5) -> None:
        self.spec, self.name = spec, spec["name"]
        self.restart_policy, self.pod_ip = restart_policy, pod_ip
        self._image, self._build = image, build
        self.podnet, self.flow_log, self.log_path = podnet, flow_log, log_path
        self._changed = changed
        self.grace_seconds = grace_seconds  # the pod's terminationGracePeriodSeconds
        self.backoff_base, self.probe_tick = backoff_base, probe_tick
        self.restart_count = 0
        self.ready = False
        self.started = False
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict[str, Any] = {}
        self.process: ContainerProcess | None = None
        self.done = False  # terminated and will not restart
        self._stopping = asyncio.Event()

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
                "ready": self.ready, "started": self.started, "restartCount": self.restart_count,
                "state": self.state, "lastState": self.last_state}

    def _set(self, **changes: Any) -> None:
        for key, value in changes.items():
            setattr(self, key, value)
        self._changed()

    async def run(self) -> None:
        backoff = 0.0  # the first retry is immediate, later ones wait backoff_base, doubling
        while not self._stopping.is_set():
            image = self._image(self.spec.get("image", ""))
            spec: ProcessSpec | None = None
            if image is None:
                reason = "ImagePullBackOff" if backoff else "ErrImagePull"
                self._set(state={"waiting": {"reason": reason, "message":
                          f'image "{self.spec.get("image")}" is not available on this node'}})
            else:
                try:
                    spec = self._build(image)
                except ConfigError as e:
                    self._set(state={"waiting": {"reason": e.reason, "message": str(e)}})
            if spec is not None:
                started = time.monotonic()
                exit_code, reason = await self._run_once(spec)
                if self._stopping.is_set():
                    break
                if time.monotonic() - started > BACKOFF_RESET_AFTER:
                    backoff = 0.0
                if not should_restart(self.restart_policy, exit_code):
                    self._set(done=True)
                    return
                self.restart_count += 1
                if backoff:
                    self._set(state={"waiting": {"reason": "CrashLoopBackOff", "message":
                              f"back-off {backoff:.0f}s restarting failed container"}})
                log.info("container %s exited (%s, code %s); restart in %.0fs", self.name,
                         reason, exit_code, backoff)
            await self._sleep(backoff)
            backoff = min(BACKOFF_MAX, backoff * 2) if backoff else self.backoff_base

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _run_once(self, spec: ProcessSpec) -> tuple[int, str]:
        self.process = ContainerProcess(spec, self.pod_ip, self.podnet, self.flow_log, self.log_path)
        try:
            await self.process.start()
        except OSError as e:
            self._set(state={"waiting": {"reason": "RunContainerError", "message": str(e)}})
            return 128, "StartError"
        self.log_path.with_suffix(".pid").write_text(str(self.process.pid))
        self._set(state={"running": {"startedAt": now_iso()}}, ready=False, started=False)
        prober = asyncio.create_task(self._probe(spec))
        waiter = asyncio.create_task(self.process.wait())
        done, _ = await asyncio.wait({prober, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if prober in done and waiter not in done:  # liveness or startup failed: kill it
            await self.process.stop(self.grace_seconds)
            reason = prober.result()
        else:
            reason = None
            prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await prober
        code = await waiter
        reason = reason or ("Completed" if code == 0 else "Error")
        terminated = {"terminated": {"exitCode": code, "reason": reason, "finishedAt": now_iso(),
                                     "startedAt": self.state.get("running", {}).get("startedAt")}}
        self._set(last_state=terminated, state=terminated, ready=False, started=False)
        return code, reason

    async def _probe(self, spec: ProcessSpec) -> str:
        """Runs until liveness or startup fails; returns the reason to kill the container."""
        loop = asyncio.get_running_loop()
        states = {kind: probes.ProbeState(self.spec[kind]) for kind in
                  ("startupProbe", "livenessProbe", "readinessProbe") if self.spec.get(kind)}
        for state in states.values():
            state.start(loop.time())
        if "startupProbe" not in states:
            self._set(started=True)
        if "readinessProbe" not in states:
            self._set(ready=self.started)
        while True:
            now = loop.time()
            for kind, state in states.items():
                if kind != "startupProbe" and not self.started:
                    continue
                if kind == "startupProbe" and self.started:
                    continue
                if not state.due(now):
                    continue
                passed = await probes.check(state.spec, self.pod_ip, spec.ports, state.timeout)
                verdict = state.record(passed, loop.time())
                if kind == "startupProbe" and verdict is True:
                    self._set(started=True, ready="readinessProbe" not in states)
                    for other in ("livenessProbe", "readinessProbe"):
                        if other in states:
                            states[other].start(loop.time())
                elif kind in ("startupProbe", "livenessProbe") and verdict is False:
                    return "Unhealthy"
                elif kind == "readinessProbe" and verdict is not None and verdict != self.ready:
                    self._set(ready=verdict)
            await asyncio.sleep(self.probe_tick)

    async def stop(self, grace_seconds: float) -> None:
        self._stopping.set()
        if self.process is not None:
            await self.process.stop(grace_seconds)
