"""Per-request token streams: opened when a request is created here (before its first
token), consumed by one server-sent-events response, and redirected when the sequence
migrates to another worker.

The engine thread delivers RequestOutputs into the queue opened here; this module also puts
in markers of its own: `Redirect` (the sequence now lives on another worker: proxy its
stream), `Ended` (aborted without a token) and exceptions (a clear error for the client).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from baton.engine.outputs import RequestOutput
from baton.server import sse

log = logging.getLogger(__name__)
KEEPALIVE_S = 10.0


@dataclass(frozen=True)
class Redirect:
    target: str  # base URL of the worker that continues the sequence


@dataclass(frozen=True)
class Ended:
    reason: str


@dataclass
class _Entry:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    opened_at: float = field(default_factory=time.monotonic)
    claimed: bool = False
    output_seen_at: float | None = None  # when a sweep first found output nobody reads


class StreamBook:
    def __init__(self, async_engine):
        self.ae = async_engine
        self._entries: dict[str, _Entry] = {}

    def open(self, request_id: str) -> None:
        """Start buffering a request's outputs (call on the server's loop before it runs)."""
        if request_id in self._entries:
            raise ValueError(f"request id {request_id!r} already has a stream here")
        queue = self.ae.open_stream(request_id)
        self._entries[request_id] = _Entry(queue, asyncio.get_running_loop())

    def claim(self, request_id: str) -> asyncio.Queue | None:
        """The queue for the one consumer of this stream (None: unknown or already taken)."""
        entry = self._entries.get(request_id)
        if entry is None or entry.claimed:
            return None
        entry.claimed = True
        return entry.queue

    def has(self, request_id: str) -> bool:
        return request_id in self._entries

    def push(self, request_id: str, item) -> None:
        """Add a marker or output; safe from any thread."""
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.loop.call_soon_threadsafe(entry.queue.put_nowait, item)

    def close(self, request_id: str) -> None:
        if self._entries.pop(request_id, None) is not None:
            self.ae.close_stream(request_id)

    def sweep_unclaimed(self, max_age_s: float, is_live: Callable[[str], bool]) -> None:
        """Forget streams nobody came for whose requests are over (no leak per request)."""
        now = time.monotonic()
        for rid, entry in list(self._entries.items()):
            if not entry.claimed and now - entry.opened_at > max_age_s and not is_live(rid):
                self.close(rid)

    def orphans(self, claim_timeout_s: float) -> list[str]:
        """Requests producing tokens that nobody claimed within `claim_timeout_s` of the
        first one: whoever asked for them (a router that died) will never read them."""
        now = time.monotonic()
        found = []
        for rid, entry in self._entries.items():
            if entry.claimed or entry.queue.empty():
                continue
            if entry.output_seen_at is None:
                entry.output_seen_at = now
            elif now - entry.output_seen_at > claim_timeout_s:
                found.append(rid)
        return found


async def relay(
    book: StreamBook,
    request_id: str,
    queue: asyncio.Queue,
    *,
    follow: Callable[[str, str], AsyncIterator[str]],
    on_abandon: Callable[[str, str | None], object],
    token_timeout_s: float,
) -> AsyncIterator[str]:
    """SSE text of one request: its outputs here, then (after a migration) the target's.

    `follow(target, request_id)` yields the target's raw SSE lines; `on_abandon(request_id,
    target)` stops the request when the client goes away before it finished.
    """
    done = False
    target = None
    try:
        while True:
            silent_since = time.monotonic()
            item = None
            while item is None:
                try:
                    item = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    if time.monotonic() - silent_since >= token_timeout_s:
                        break
                    yield sse.KEEPALIVE  # a long wait (KV in flight, long prefill) is not a dead stream
            if item is None:
                yield sse.encode(_error(f"no token for {request_id!r} within {token_timeout_s}s", "timeout"))
                yield sse.DONE
                return
            if isinstance(item, RequestOutput):
                yield sse.encode(sse.output_event(item))
                if item.finished:
                    done = True
                    yield sse.DONE
                    return
            elif isinstance(item, Redirect):
                target = item.target
                book.close(request_id)
                async for chunk in follow(target, request_id):
                    if chunk == sse.DONE:
                        done = True
                    yield chunk
                if not done:
                    yield sse.encode(_error(f"stream of {request_id!r} from {target} ended early", "upstream"))
                    yield sse.DONE
                done = True
                return
            elif isinstance(item, Ended):
                done = True
                yield sse.encode(sse.ended_event(request_id, item.reason))
                yield sse.DONE
                return
            elif isinstance(item, Exception):
                done = True
                yield sse.encode(_error(str(item), "engine_error"))
                yield sse.DONE
                return
    finally:
        book.close(request_id)
        if not done:
            # The client went away, so this task is being cancelled: any await here would be
            # cancelled too. The abort runs in a task of its own, with its own deadline.
            _detach(on_abandon(request_id, target), request_id)


_detached: set[asyncio.Task] = set()  # strong references until they end
ABANDON_DEADLINE_S = 30.0


def _detach(coro, request_id: str) -> None:
    async def run():
        try:
            await asyncio.wait_for(coro, ABANDON_DEADLINE_S)
        except Exception:
            log.exception("stopping abandoned request %s failed", request_id)

    task = asyncio.get_running_loop().create_task(run())
    _detached.add(task)
    task.add_done_callback(_detached.discard)


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "stream_error", "code": code}}
