"""A lean HTTP/1.1 client for the router's hot worker calls.

aiohttp spends about a millisecond of Python on each streamed request, and the router makes
one on every request's path to its first token. This client does only what the internal
API needs: persistent keep-alive connections per worker, one request written in a single
send, the status, then the body as it arrives (Content-Length or chunked), parsed by
httptools. A connection is reused only after its response was read to the end.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from functools import lru_cache
from urllib.parse import urlsplit

import httptools

from baton.server.keepalive import CLIENT_IDLE_S

_HIGH_WATER = 1 << 20  # buffered body bytes before reading from the socket pauses
_LOW_WATER = 1 << 18


class HttpError(ConnectionError):
    """The connection failed or broke, or the answer was not HTTP."""


@lru_cache(maxsize=1024)
def split_url(url: str) -> tuple[str, int, str, str]:
    """http://host:port/path -> (host, port, "host:port", path); plain http only."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not a plain http URL: {url}")
    port = parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname, port, parts.netloc, path


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no data from the worker in time"))


class Connection(asyncio.Protocol):
    """One keep-alive connection; one exchange at a time. The response's parts are kept
    as they arrive and handed out by `read_status` and `read_piece`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int):
        self.loop = loop
        self.host, self.port = host, port
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future | None = None
        self._when_complete = None  # a callback for a response left before its end
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.got_bytes = False
        self.error: Exception | None = None
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = HttpError(f"the worker closed the connection{f': {exc}' if exc else ''}")
        self._wake()

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.error = HttpError(f"malformed HTTP answer: {e}")
            self.close()
        if self._buffered > _HIGH_WATER and not self._paused and not self.closed:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    # -- httptools callbacks -------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        if not self.parser.should_keep_alive():
            self.close()
        if self._when_complete is not None:
            callback, self._when_complete = self._when_complete, None
            callback()

    # -- the exchange --------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        self._reset()
        self.transport.write(data)

    async def read_status(self, timeout_s: float) -> int:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self._wait(timeout_s)
        return self.status

    async def read_piece(self, timeout_s: float) -> bytes | None:
        """The next part of the body as it came in; None at its end."""
        while True:
            if self._pieces:
                piece = self._pieces.popleft()
                self._buffered -= len(piece)
                if self._paused and self._buffered < _LOW_WATER and not self.closed:
                    self._paused = False
                    self.transport.resume_reading()
                return piece
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            await self._wait(timeout_s)

    async def read_all(self, timeout_s: float) -> bytes:
        pieces = []
        while (piece := await self.read_piece(timeout_s)) is not None:
            pieces.append(piece)
        return b"".join(pieces)

    async def _wait(self, timeout_s: float) -> None:
        self._waiter = waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        self.closed = True
        self._when_complete = None
        if self.transport is not None:
            self.transport.close()


class Http1Pool:
    """Idle keep-alive connections per worker. Idle ones are dropped well before the
    workers' own keep-alive timeout (keepalive.py) so a request rarely meets a closing one;
    when it does (the connection breaks before any answer), it is sent again on a fresh one."""

    def __init__(self, connect_timeout_s: float = 3.0, idle_ttl_s: float = CLIENT_IDLE_S,
                 max_idle_per_worker: int = 64, drain_timeout_s: float = 5.0):
        self.connect_timeout_s = connect_timeout_s
        self.idle_ttl_s = idle_ttl_s
        self.max_idle_per_worker = max_idle_per_worker
        self.drain_timeout_s = drain_timeout_s
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._closed = False

    async def request(self, host: str, port: int, data: bytes, timeout_s: float) -> Connection:
        """Send one whole request (head and body in `data`); return the connection once the
        answer's status is in. The caller must hand it back with `done`."""
        for attempt in (0, 1):
            conn, reused = await self._acquire(host, port)
            conn.send(data)
            try:
                await conn.read_status(timeout_s)
                return conn
            except HttpError:
                conn.close()
                if not (reused and not conn.got_bytes and attempt == 0):
                    raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def done(self, conn: Connection, *, finish: bool = False) -> None:
        """Keep the connection if its response was read to the end; with `finish`, also
        when the rest of it (the chunked terminator, usually) arrives shortly."""
        if conn.closed or conn.error is not None:
            conn.close()
        elif conn.complete:
            self._keep(conn)
        elif finish:
            timer = conn.loop.call_later(self.drain_timeout_s, conn.close)

            def finished() -> None:
                timer.cancel()
                self._keep(conn)

            conn._when_complete = finished
        else:
            conn.close()

    def _keep(self, conn: Connection) -> None:
        if conn.closed:
            return
        if self._closed:
            conn.close()
            return
        idle = self._idle.setdefault((conn.host, conn.port), [])
        if len(idle) >= self.max_idle_per_worker:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _acquire(self, host: str, port: int) -> tuple[Connection, bool]:
        idle = self._idle.get((host, port))
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_ttl_s:
                return conn, True
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: Connection(loop, host, port), host, port)
        except TimeoutError as e:
            raise HttpError(f"connecting to {host}:{port} timed out") from e
        except OSError as e:
            raise HttpError(f"cannot connect to {host}:{port}: {e}") from e
        return conn, False

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
