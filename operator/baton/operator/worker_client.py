"""The operator's only way to talk to workers: their internal HTTP API (docs/contracts.md)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from baton.server.keepalive import worker_http_client
from baton.server.role_request import REGROUP_TIMEOUT_S, role_request


class WorkerUnreachable(Exception):
    """The worker did not answer, or answered with an error."""


@dataclass(frozen=True)
class DrainState:
    state: str  # "draining" or "drained"
    running: int

    @property
    def drained(self) -> bool:
        return self.state == "drained"


class WorkerClient:
    def __init__(self, token: str | None, port: int, timeout: float = 5.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._port = port
        self._client = worker_http_client(headers=headers, timeout=timeout)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> WorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def port(self) -> int:
        return self._port

    def _url(self, ip: str, path: str) -> str:
        host = f"[{ip}]" if ":" in ip else ip
        return f"http://{host}:{self._port}{path}"

    async def _request(self, method: str, ip: str, path: str, json: dict | None = None,
                       timeout: float | None = None) -> dict:
        try:
            extra = {} if timeout is None else {"timeout": timeout}
            response = await self._client.request(method, self._url(ip, path), json=json, **extra)
        except httpx.HTTPError as error:
            raise WorkerUnreachable(f"{method} {path} on {ip}: {error!r}") from error
        if response.status_code >= 400:
            raise WorkerUnreachable(f"{method} {path} on {ip}: HTTP {response.status_code}")
        try:
            return response.json() if response.content else {}
        except ValueError:
            return {}

    async def start_drain(self, ip: str, peers: list[str]) -> None:
        """Ask the worker to drain; a decode worker migrates its running sequences to the
        first of `peers` (worker base URLs) with room, and finishes the rest itself."""
        await self._request("POST", ip, "/internal/drain", json={"peers": peers})

    async def drain_state(self, ip: str) -> DrainState:
        body = await self._request("GET", ip, "/internal/drain")
        return DrainState(state=str(body.get("state", "draining")),
                          running=int(body.get("running", 0)))

    async def set_role(self, ip: str, role: str, tensor_parallel_size: int | None = None) -> None:
        """Switch a drained worker's role (and its ranks, when `tensor_parallel_size` is given)."""
        await self._request("POST", ip, "/internal/role", json=role_request(role, tensor_parallel_size),
                            timeout=REGROUP_TIMEOUT_S)

    async def state(self, ip: str) -> dict:
        return await self._request("GET", ip, "/internal/state")
