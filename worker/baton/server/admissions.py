"""Waits for the engine to start queued requests.

A worker answers /internal/generate with 200 only once the engine runs the request (or
has finished it): until then its caller can still get a plain 429 when the KV pool or the
batch stays full past the queue deadline, instead of a stream that opened and then fails.
"""

from __future__ import annotations

import asyncio

from baton.engine.sequence import SequenceStatus


class Admissions:
    def __init__(self):
        # request id -> (the waiter's loop, its event); filled and emptied on the engine
        # thread, dropped from the server's loop (single dict operations, atomic under the GIL)
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}

    def waiter(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Event]:
        """On the server's loop: what `watch` will set."""
        return asyncio.get_running_loop(), asyncio.Event()

    def watch(self, request_id: str, waiter: tuple[asyncio.AbstractEventLoop, asyncio.Event]) -> None:
        """On the engine thread, right after the request was added: a watch made before it
        existed would take "no such sequence" for "it finished" and wake the waiter early."""
        self._waiting[request_id] = waiter

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def after_step(self, engine) -> None:
        """On the engine thread after each step: wake the waiters whose request left the queue."""
        for request_id, (loop, event) in list(self._waiting.items()):
            seq = engine.sequences.get(request_id)
            if seq is None or seq.status != SequenceStatus.WAITING:
                self._waiting.pop(request_id, None)
                loop.call_soon_threadsafe(event.set)
