"""Calls from this worker to other workers' internal API (migration, drain)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from baton.server import sse
from baton.server.keepalive import worker_http_client


class PeerError(Exception):
    def __init__(self, status: int, message: str, code: str = ""):
        super().__init__(message)
        self.status = status
        self.code = code


class Peers:
    def __init__(self, token: str | None, timeout_s: float = 30.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = worker_http_client(headers=headers, timeout=timeout_s)

    async def close(self) -> None:
        await self.client.aclose()

    async def post(self, base: str, path: str, body: dict | None = None) -> dict:
        try:
            resp = await self.client.post(base.rstrip("/") + path, json=body or {})
        except httpx.HTTPError as exc:
            raise PeerError(502, f"{base}: {exc!r}", "unreachable") from None
        try:
            doc = resp.json()
        except ValueError:
            doc = {}
        if resp.status_code >= 400:
            err = doc.get("error", {}) if isinstance(doc, dict) else {}
            raise PeerError(resp.status_code, f"{base}{path}: {err.get('message', resp.text)}", err.get("code", ""))
        return doc

    async def follow(self, base: str, request_id: str) -> AsyncIterator[str]:
        """The raw SSE events of a request's stream on another worker, [DONE] included."""
        url = f"{base.rstrip('/')}/internal/stream/{request_id}"
        try:
            async with self.client.stream("GET", url, timeout=httpx.Timeout(30.0, read=600.0)) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    yield sse.encode({"error": {"message": f"{url}: {resp.status_code} {resp.text}", "type": "stream_error", "code": "upstream"}})
                    yield sse.DONE
                    return
                async for line in resp.aiter_lines():
                    if line.startswith(":"):
                        yield sse.KEEPALIVE  # pass the target's keepalives on to our reader
                        continue
                    data = sse.data_of(line)
                    if data is None:
                        continue
                    yield f"data: {data}\n\n"
                    if data == "[DONE]":
                        return
        except httpx.HTTPError as exc:
            yield sse.encode({"error": {"message": f"{url}: {exc!r}", "type": "stream_error", "code": "upstream"}})
            yield sse.DONE
