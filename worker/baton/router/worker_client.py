"""HTTP calls to workers' internal API (docs/contracts.md): event streams over http1.py, the rest over aiohttp."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp

from baton.router.http1 import Http1Pool, split_url
from baton.router.sse import DONE, SseLines, parse_sse_line
from baton.server.keepalive import CLIENT_IDLE_S

__all__ = ["ACCEPTED", "DONE", "WorkerBusy", "WorkerClient", "WorkerRefused", "WorkerRejected",
           "WorkerUnavailable", "parse_sse_line"]


# The first event of every stream: the worker answered 200, so it took the request (the
# router can commit to a 200 of its own before the first token).
ACCEPTED: dict = {"accepted": True}


class WorkerUnavailable(Exception):
    """Connection failed, timed out, or the worker answered 5xx: try another worker."""


class WorkerRefused(Exception):
    """The worker declined (409: no KV room): try another worker."""


class WorkerBusy(Exception):
    """429: the worker queued the request until its queue deadline without room to run it.
    Not a failed worker: the pool is full, and the client is told to retry later."""


class WorkerRejected(Exception):
    """The worker found the request itself invalid (4xx): retrying elsewhere won't help."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error_message(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    except (ValueError, AttributeError):
        return body[:500].decode(errors="replace")


def _raise_for(status: int, body: bytes, what: str) -> None:
    if status < 400:
        return
    message = f"{what}: {status} {_error_message(status, body)}"
    if status == 409:
        raise WorkerRefused(message)
    if status == 429:
        raise WorkerBusy(message)
    if 400 <= status < 500 and status not in (404, 408):
        raise WorkerRejected(status, message)
    raise WorkerUnavailable(message)


class WorkerClient:
    """The event streams (generate, stream), on every request's path to its first token,
    go over the lean keep-alive client in http1.py; the rest over one aiohttp session."""

    def __init__(self, internal_token: str | None = None, connect_timeout_s: float = 3.0,
                 token_timeout_s: float = 60.0, max_connections: int = 2048):
        self.headers = {"Authorization": f"Bearer {internal_token}"} if internal_token else {}
        self.connect_timeout_s = connect_timeout_s
        self.token_timeout_s = token_timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self.http1 = Http1Pool(connect_timeout_s)
        auth = f"Authorization: Bearer {internal_token}\r\n" if internal_token else ""
        self._head_fields = f"{auth}Accept: text/event-stream\r\n"

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:  # made lazily: it needs the running loop
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                connector=aiohttp.TCPConnector(limit=self.max_connections, ttl_dns_cache=300,
                                               keepalive_timeout=CLIENT_IDLE_S),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s,
                                              sock_read=self.token_timeout_s))
        return self._session

    async def close(self) -> None:
        self.http1.close()
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, url: str, what: str, timeout_s: float | None = None,
                    **kwargs) -> bytes:
        if timeout_s is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout_s, connect=self.connect_timeout_s)
        try:
            async with self.session.request(method, url, **kwargs) as response:
                body = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise WorkerUnavailable(f"{what}: {type(e).__name__} {e}") from e
        _raise_for(status, body, what)
        return body

    async def _json(self, method: str, url: str, what: str, timeout_s: float | None = None, **kwargs) -> dict:
        body = await self._call(method, url, what, timeout_s, **kwargs)
        try:
            return json.loads(body)
        except ValueError as e:
            raise WorkerUnavailable(f"{what}: malformed answer {e}") from e

    async def state(self, url: str, timeout_s: float = 2.0) -> dict:
        return await self._json("GET", f"{url}/internal/state", "state", timeout_s)

    async def metrics_text(self, url: str, timeout_s: float = 2.0) -> str:
        return (await self._call("GET", f"{url}/metrics", "metrics", timeout_s)).decode(errors="replace")

    async def reserve(self, url: str, request_id: str, prompt_ids: list[int], params: dict,
                      headroom_tokens: int, timeout_s: float = 10.0) -> dict:
        body = {"request_id": request_id, "prompt_token_ids": prompt_ids, "params": params,
                "headroom_tokens": headroom_tokens}
        return (await self._json("POST", f"{url}/internal/reserve", "reserve", timeout_s, json=body))["ticket"]

    async def prefill(self, url: str, request_id: str, prompt_ids: list[int], params: dict,
                      ticket: dict, timeout_s: float) -> dict:
        body = {"request_id": request_id, "prompt_token_ids": prompt_ids, "params": params,
                "ticket": ticket}
        return await self._json("POST", f"{url}/internal/prefill", "prefill", timeout_s, json=body)

    async def abort(self, url: str, request_id: str) -> None:
        try:
            await self._call("POST", f"{url}/internal/abort/{request_id}", "abort", 2.0)
        except (WorkerUnavailable, WorkerRejected, WorkerRefused):
            pass  # best effort: the worker frees abandoned requests itself

    def generate(self, url: str, request_id: str, prompt_ids: list[int], params: dict) -> AsyncIterator[dict]:
        body = {"request_id": request_id, "prompt_token_ids": prompt_ids, "params": params}
        return self._events("POST", f"{url}/internal/generate", "generate", body)

    def stream(self, url: str, request_id: str) -> AsyncIterator[dict]:
        return self._events("GET", f"{url}/internal/stream/{request_id}", "stream")

    def _events(self, method: str, url: str, what: str, body: dict | None = None) -> AsyncIterator[dict]:
        if url.startswith("http://"):
            return self._lean_events(method, url, what, body)
        return self._aiohttp_events(method, url, what, **({"json": body} if body is not None else {}))

    def _request_bytes(self, method: str, netloc: str, path: str, body: dict | None) -> bytes:
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        kind = "Content-Type: application/json\r\n" if body is not None else ""
        head = (f"{method} {path} HTTP/1.1\r\nHost: {netloc}\r\n{self._head_fields}{kind}"
                f"Content-Length: {len(payload)}\r\n\r\n")
        return head.encode() + payload

    async def _lean_events(self, method: str, url: str, what: str, body: dict | None) -> AsyncIterator[dict]:
        """The worker's events until [DONE]; a broken or silent stream raises WorkerUnavailable."""
        host, port, netloc, path = split_url(url)
        timeout_s = self.token_timeout_s
        try:
            conn = await self.http1.request(host, port, self._request_bytes(method, netloc, path, body), timeout_s)
        except (OSError, ValueError) as e:  # HttpError and TimeoutError are OSErrors
            raise WorkerUnavailable(f"{what}: {type(e).__name__} {e}") from e
        finished = False
        try:
            if conn.status >= 400:
                _raise_for(conn.status, await conn.read_all(timeout_s), what)
            yield ACCEPTED
            lines = SseLines()
            while (piece := await conn.read_piece(timeout_s)) is not None:
                for event in lines.feed(piece):
                    if event is DONE:
                        finished = True
                        return
                    if "error" in event and "token_ids" not in event:
                        raise WorkerUnavailable(f"{what}: the worker reported {event['error']}")
                    yield event
            raise WorkerUnavailable(f"{what}: the stream ended without [DONE]")
        except OSError as e:
            raise WorkerUnavailable(f"{what}: {type(e).__name__} {e}") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WorkerUnavailable(f"{what}: malformed event {e}") from e
        finally:
            self.http1.done(conn, finish=finished)

    async def _aiohttp_events(self, method: str, url: str, what: str, **kwargs) -> AsyncIterator[dict]:
        """The worker's events until [DONE]; a broken or silent stream raises WorkerUnavailable."""
        try:
            async with self.session.request(method, url, **kwargs) as response:
                if response.status >= 400:
                    _raise_for(response.status, await response.read(), what)
                yield ACCEPTED
                async for raw in response.content:
                    event = parse_sse_line(raw.decode())
                    if event is DONE:
                        return
                    if event is None:
                        continue
                    if "error" in event and "token_ids" not in event:
                        raise WorkerUnavailable(f"{what}: the worker reported {event['error']}")
                    yield event
            raise WorkerUnavailable(f"{what}: the stream ended without [DONE]")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise WorkerUnavailable(f"{what}: {type(e).__name__} {e}") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WorkerUnavailable(f"{what}: malformed event {e}") from e
