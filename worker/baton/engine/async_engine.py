"""The step loop on its own thread, driven from asyncio (the worker server uses this).

The engine itself is single-threaded: every call into it (add, abort, reserve, migrate)
is queued and run on the engine thread between steps, so no locks are needed and an
HTTP handler never blocks the event loop on model work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from baton.engine.commit_hold import Arrival, hold_s, may_hold
from baton.engine.engine import Engine
from baton.engine.outputs import RequestOutput
from baton.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request (reported to that request's stream)."""


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        # called on the engine thread after every step: fn(outputs, step_seconds, batch_tokens)
        self.step_observers: list[Callable[[list[RequestOutput], float], None]] = []
        # A decode worker's prompts arriving from prefill workers (engine/commit_hold.py):
        # the forecast is read on the engine thread; a step with decodes waits up to
        # commit_hold_fraction of a recent step for a commit due that soon (0: never).
        self.commit_forecast: Callable[[], list[Arrival]] | None = None
        self.commit_hold_fraction = 0.0
        self.held_s = 0.0  # time spent holding steps for commits, and how many holds
        self.holds = 0
        self._recent_step_s: float | None = None  # moving averages of steps with decodes
        self._recent_hold_s = 0.0  # and of the holds before them

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    # -- calls into the engine thread ------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args, timeout_s: float = 60.0, **kwargs) -> Any:
        """Run fn(engine, *args, **kwargs) on the engine thread; return or raise its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((future, fn, args, kwargs))
        self._wake.set()
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Receive this request's outputs on the calling event loop (register before it runs)."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        prefill_only: bool = False,
        token_timeout_s: float = 120.0,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes; aborts it if abandoned."""
        q = self.open_stream(request_id)
        try:
            arrived = time.monotonic()
            await self.call(lambda e: e.add_request(prompt, params, request_id, prefill_only, arrived))
        except BaseException:
            self.close_stream(request_id)
            raise
        finished = False
        try:
            async for out in self.iterate(q, token_timeout_s):
                finished = out.finished
                yield out
        finally:
            self.close_stream(request_id)
            if not finished:
                await self.call(lambda e: e.abort(request_id) and e.release(request_id))

    @staticmethod
    async def iterate(q: asyncio.Queue, token_timeout_s: float) -> AsyncIterator[RequestOutput]:
        while True:
            item = await asyncio.wait_for(q.get(), token_timeout_s)
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return

    # -- the loop ------------------------------------------------------------------
    def _run_commands(self) -> None:
        while True:
            try:
                future, fn, args, kwargs = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine, *args, **kwargs))
            except BaseException as e:  # handed to the caller, never kills the loop
                future.set_exception(e)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            decoding = bool(self.engine.scheduler.running)
            held = self._hold_for_commits() if decoding and self.commit_forecast is not None else 0.0
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bad step fails its requests, not the worker
                log.exception("engine step failed")
                self._fail_running(e)
                continue
            elapsed = time.perf_counter() - started
            if decoding:
                recent = self._recent_step_s
                self._recent_step_s = elapsed if recent is None else 0.8 * recent + 0.2 * elapsed
                self._recent_hold_s = 0.8 * self._recent_hold_s + 0.2 * held
            for observer in self.step_observers:
                observer(outputs, elapsed)
            for out in outputs:
                self._deliver(out)
            if not outputs and not self.engine.scheduler.running:
                # only queued sequences that do not fit: nothing changes until a call frees
                # room (an abort, a release) or brings work, so wait for one, not spin
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()

    def _hold_for_commits(self) -> float:
        """Wait (within the budget) for commits due before the next step, running each as
        it comes, so a prompt whose KV is nearly in joins this step instead of the next.
        Returns the seconds held."""
        recent = self._recent_step_s
        if recent is None or self.commit_hold_fraction <= 0 or not may_hold(self._recent_hold_s, recent):
            return 0.0
        began = time.monotonic()
        end = began + self.commit_hold_fraction * recent
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                wait = hold_s(self.commit_forecast(), now, end - now)
            except Exception:  # a forecast is advice: never let it stop the loop
                log.exception("commit forecast failed")
                wait = 0.0
            if wait <= 0:
                break
            self._wake.wait(wait)
            self._wake.clear()
            self._run_commands()
        held = time.monotonic() - began
        if held > 0.0005:
            self.held_s += held
            self.holds += 1
        return held

    def _deliver(self, item: RequestOutput) -> None:
        target = self._streams.get(item.request_id)
        if item.finished and item.finish_reason != "prefill":
            self.engine.release(item.request_id)  # bookkeeping only: blocks are already free
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, EngineError(item.error) if item.error else item)

    def _fail_running(self, error: Exception) -> None:
        for request_id, seq in list(self.engine.sequences.items()):
            if seq.is_finished:
                continue
            self.engine.abort(request_id)
            self.engine.release(request_id)
            target = self._streams.get(request_id)
            if target is not None:
                loop, q = target
                loop.call_soon_threadsafe(q.put_nowait, EngineError(f"engine step failed: {error}"))
