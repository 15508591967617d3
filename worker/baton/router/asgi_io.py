"""Small ASGI pieces for the completion endpoints.

Starlette's request/response machinery (a middleware stack, a Request, a task group per
streamed response) costs about a millisecond of Python per request, all of it on the path
to the first token; these do the same job with a few sends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

JSON_TYPE = (b"content-type", b"application/json")
SSE_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")


# A request body beyond this is refused (413) as soon as it is announced or read that far,
# never buffered: a prompt that fills the longest context is well under 1 MiB of JSON.
MAX_BODY_BYTES = 4 << 20


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class BodyTooLarge(Exception):
    """The request body exceeds MAX_BODY_BYTES."""


def header(scope: dict, name: bytes) -> bytes | None:
    """The first value of a header (`name` in lower case, as servers pass them)."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def read_body(receive, limit: int = MAX_BODY_BYTES, scope: dict | None = None) -> bytes:
    """The whole body, or BodyTooLarge once its declared or received size passes `limit`."""
    declared = header(scope, b"content-length") if scope is not None else None
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body has {int(declared)} bytes; the limit is {limit}")
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise BodyTooLarge(f"the request body exceeds the limit of {limit} bytes")
        parts.append(part)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def json_bytes(payload) -> bytes:
    """As Starlette's JSONResponse renders it."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode()


async def send_bytes(send, status: int, body: bytes, content_type: tuple[bytes, bytes] = JSON_TYPE,
                     headers: dict[str, str] | None = None) -> None:
    fields = [(b"content-length", str(len(body)).encode()), content_type]
    for name, value in (headers or {}).items():
        fields.append((name.lower().encode(), value.encode()))
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": body})


async def send_json(send, status: int, payload, headers: dict[str, str] | None = None) -> None:
    await send_bytes(send, status, json_bytes(payload), JSON_TYPE, headers)


class DisconnectWatch:
    """Cancels the task that made it when the client disconnects, until `done()`.

    The handler catches the CancelledError and asks `left()` whether it was this watch's:
    closing its generators on the way out aborts the work on the workers.
    """

    def __init__(self, receive):
        self.task = asyncio.current_task()
        self.ended = False
        self.gone = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.ended:  # after the answer went out, a disconnect is just the end
            self.gone = True
            self.task.cancel()

    def done(self) -> None:
        self.ended = True
        self._watcher.cancel()

    def left(self) -> bool:
        """In an `except CancelledError`: True when the cancellation was the client leaving
        (and is now absorbed), False when it must propagate."""
        return self.gone and self.task.uncancel() == 0


async def send_event_stream(receive, send, events: AsyncIterator[bytes],
                            watch: DisconnectWatch | None = None) -> None:
    """Stream `events` as they come. A client that leaves mid-stream cancels the wait for
    the next event, which closes `events` (and so aborts the work behind them). `watch`:
    one already watching this request's client (else one starts after the first event)."""
    await send({"type": "http.response.start", "status": 200, "headers": [SSE_TYPE]})
    try:
        async with aclosing(events):
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
                if watch is None:  # started after the first event: off the path to it
                    watch = DisconnectWatch(receive)
        if watch is not None:
            watch.ended = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if watch is not None and watch.left():
            return  # the client left, nothing more to do
        raise
    finally:
        if watch is not None:
            watch.done()
