"""Acting on a local fleet (`baton up --autoscale`): convert workers over their internal API.

No Kubernetes here: the actuator drives a conversion itself, as the operator would for a pod:
POST /internal/drain (with the peers a decode worker may migrate its sequences to), poll
GET /internal/drain until drained or the deadline passes, then POST /internal/role. The
router follows on its own: it polls each worker's /internal/state and stops sending work
to one that is not active. Pool resizing needs a hook from the local runtime that starts or
stops worker processes (or Ray actors); without one, elastic decisions are refused.

`baton up --autoscale` is expected to build it as
    RayActuator(workers=lambda: [w.url for w in runtime.workers], token=runtime.token,
                scale=runtime.scale_pools)   # scale: optional async (prefill, decode) -> None
and hand it to a Controller with a ScrapeSource over the same URLs.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import httpx

from baton.server.keepalive import worker_http_client
from baton.server.role_request import REGROUP_TIMEOUT_S, role_request

from .actuator import ActuationError
from .estimate import ConversionTimes, PoolState
from .inputs import Action, Decision

log = logging.getLogger(__name__)

WorkerUrls = Sequence[str] | Callable[[], Sequence[str] | Awaitable[Sequence[str]]]
ScaleHook = Callable[[int, int], Awaitable[None]]
SOURCE_ROLE = {Action.CONVERT_DECODE_TO_PREFILL: "decode",
               Action.CONVERT_PREFILL_TO_DECODE: "prefill"}
TARGET_ROLE = {Action.CONVERT_DECODE_TO_PREFILL: "prefill",
               Action.CONVERT_PREFILL_TO_DECODE: "decode"}


@dataclass(frozen=True)
class WorkerState:
    url: str
    role: str
    state: str
    running: int


def choose_worker(states: list[WorkerState], role: str, busy: set[str]) -> WorkerState | None:
    """The active worker of `role` with the fewest running sequences (least to migrate)."""
    candidates = [s for s in states if s.role == role and s.state == "active" and s.url not in busy]
    return min(candidates, key=lambda s: (s.running, s.url)) if candidates else None


def role_body(target: str, tensor_parallel_sizes: dict[str, int]) -> dict:
    """POST /internal/role's body: the new role, and its pool's size where pools differ."""
    return role_request(target, tensor_parallel_sizes.get(target))


def committed_split(states: list[WorkerState], converting: dict[str, str]) -> PoolState:
    """Workers per role counting each conversion under its target role (pure)."""
    roles = [converting.get(s.url, s.role) for s in states]
    busy = {s.url for s in states if s.state != "active"} | set(converting)
    return PoolState(roles.count("prefill"), roles.count("decode"), len(busy))


class RayActuator:
    """workers: base URLs (or a function returning them); token: the internal token
    (default: $BATON_INTERNAL_TOKEN); drain_timeout_s: longest wait for a drain; scale: the
    runtime's pool-resizing hook, if any; on_event(reason, message): progress reports;
    clock: seconds (monotonic) for timing conversions, which `pools()` reports;
    tensor_parallel_sizes: each pool's ranks per worker (`baton up --prefill-tp/--decode-tp`):
    a converted worker regroups onto its new pool's size (omitted: it keeps its own)."""

    def __init__(self, workers: WorkerUrls, token: str | None = None,
                 drain_timeout_s: float = 300.0, poll_s: float = 0.5, timeout: float = 5.0,
                 scale: ScaleHook | None = None,
                 on_event: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 tensor_parallel_sizes: dict[str, int] | None = None) -> None:
        self._workers = workers
        self.tensor_parallel_sizes = dict(tensor_parallel_sizes or {})
        token = token if token is not None else os.environ.get("BATON_INTERNAL_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = worker_http_client(headers=headers, timeout=timeout)
        self.drain_timeout_s = drain_timeout_s
        self.poll_s = poll_s
        self.scale = scale
        self.on_event = on_event or (lambda reason, message: log.info("%s: %s", reason, message))
        self.converting: dict[str, str] = {}  # url -> target role, while a task runs
        self._tasks: set[asyncio.Task] = set()
        self.clock = clock
        self.times = ConversionTimes()

    async def _urls(self) -> list[str]:
        if not callable(self._workers):
            return list(self._workers)
        found = self._workers()
        return list(await found if inspect.isawaitable(found) else found)

    async def _call(self, method: str, url: str, path: str, body: dict | None = None,
                    timeout: float | None = None) -> dict:
        try:
            extra = {} if timeout is None else {"timeout": timeout}
            response = await self._client.request(method, url.rstrip("/") + path, json=body, **extra)
        except httpx.HTTPError as error:
            raise ActuationError(f"{method} {path} on {url}: {error!r}") from error
        if response.status_code >= 400:
            raise ActuationError(f"{method} {path} on {url}: HTTP {response.status_code} "
                                 f"{response.text[:200]}")
        try:
            return response.json() if response.content else {}
        except ValueError:
            return {}

    async def states(self) -> list[WorkerState]:
        """Every worker that answers /internal/state; the silent ones are left out."""
        async def one(url: str) -> WorkerState | None:
            try:
                body = await self._call("GET", url, "/internal/state")
            except ActuationError as error:
                log.info("state of %s unknown: %s", url, error)
                return None
            return WorkerState(url, str(body.get("role", "")), str(body.get("state", "active")),
                               int(body.get("running") or 0))
        found = await asyncio.gather(*(one(u) for u in await self._urls()))
        return [s for s in found if s is not None]

    async def pools(self) -> PoolState | None:
        urls = await self._urls()
        states = await self.states()
        if not states:
            return None
        found = committed_split(states, self.converting)
        return replace(found, unreachable=len(set(urls) - {s.url for s in states}),
                       conversion_s=self.times.seconds)

    async def apply(self, decision: Decision) -> str:
        if decision.action is Action.SCALE_POOLS:
            if self.scale is None:
                raise ActuationError("this runtime has no pool-scaling hook (fixed fleet only)")
            await self.scale(*decision.target)
            return f"asked the runtime for {decision.target[0]} prefill and {decision.target[1]} decode"
        if decision.action not in SOURCE_ROLE:
            raise ActuationError(f"nothing to do for {decision.action.value}")
        states = await self.states()
        source, target = SOURCE_ROLE[decision.action], TARGET_ROLE[decision.action]
        chosen: list[WorkerState] = []
        for _ in range(max(1, decision.conversions)):
            worker = choose_worker(states, source, set(self.converting) | {w.url for w in chosen})
            if worker is None:
                break  # fewer workers to convert than asked: carry out what can be
            chosen.append(worker)
        if not chosen:
            raise ActuationError(f"no active {source} worker to convert")
        for worker in chosen:
            self.converting[worker.url] = target
            self.times.started(worker.url, self.clock())
        # Sessions migrate only to decode workers that stay decode and are not converting.
        peers = [s.url for s in states if s.role == "decode" and s.state == "active"
                 and s.url not in self.converting]
        for worker in chosen:
            task = asyncio.create_task(self.convert(worker.url, worker.role, target, peers))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return "; ".join(f"converting {w.url} from {w.role} to {target}" for w in chosen)

    async def convert(self, url: str, from_role: str, target: str, peers: list[str]) -> bool:
        """Drain -> wait -> switch role. Returns whether the worker took the new role."""
        try:
            await self._call("POST", url, "/internal/drain", {"peers": peers})
            self.on_event("ConversionStarted", f"{url}: {from_role} -> {target}, draining")
            deadline = time.monotonic() + self.drain_timeout_s
            while True:
                body = await self._call("GET", url, "/internal/drain")
                if body.get("state") == "drained":
                    break
                if time.monotonic() >= deadline:
                    # As the operator does: past the deadline the switch is tried anyway.
                    self.on_event("DrainTimeout", f"{url}: {body.get('running')} sequence(s) "
                                  f"left after {self.drain_timeout_s:.0f}s")
                    break
                await asyncio.sleep(self.poll_s)
            await self._call("POST", url, "/internal/role", role_body(target, self.tensor_parallel_sizes),
                             timeout=REGROUP_TIMEOUT_S)
            self.times.finished(url, self.clock())
            self.on_event("ConversionFinished", f"{url}: {from_role} -> {target}")
            return True
        except ActuationError as error:
            self.on_event("ConversionFailed", f"{url}: {from_role} -> {target}: {error}")
            return False
        finally:
            self.times.abandoned(url)  # a failed or cancelled conversion is not timed
            self.converting.pop(url, None)

    async def wait_idle(self) -> None:
        """Wait for the conversions in progress (tests, shutdown)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.wait_idle()
        await self._client.aclose()
