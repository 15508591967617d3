"""Probes as the kubelet runs them: the verdict logic (pure) and the checks (I/O).

A probe's result flips only after `failureThreshold` consecutive failures or
`successThreshold` consecutive successes; until the startup probe has succeeded neither
liveness nor readiness runs; a container without a readiness probe is ready once started.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class ProbeState:
    spec: dict[str, Any]
    ok: bool | None = None  # None: no verdict yet
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0
    started_at: float = 0.0
    timing: dict[str, float] = field(default_factory=dict)

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    @property
    def timeout(self) -> float:
        return float(self.spec.get("timeoutSeconds", 1))

    def start(self, now: float) -> None:
        self.ok, self.successes, self.failures = None, 0, 0
        self.started_at = now
        self.next_at = now + float(self.spec.get("initialDelaySeconds", 0))

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, passed: bool, now: float) -> bool | None:
        """Count one result; return the verdict (None while undecided)."""
        self.next_at = now + self.period
        if passed:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.spec.get("successThreshold", 1)):
                self.ok = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.spec.get("failureThreshold", 3)):
                self.ok = False
        return self.ok


def resolve_port(port: Any, named: dict[str, int]) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    if port not in named:
        raise ValueError(f"no container port named {port!r}")
    return named[port]


async def check(spec: dict[str, Any], pod_ip: str, named: dict[str, int], timeout: float) -> bool:
    """Run one probe against the pod's address; any error is a failure."""
    try:
        if "httpGet" in spec:
            get = spec["httpGet"]
            port = resolve_port(get["port"], named)
            scheme = get.get("scheme", "HTTP").lower()
            host = get.get("host") or pod_ip
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            async with httpx.AsyncClient(timeout=timeout, verify=False) as client:
                response = await client.get(f"{scheme}://{host}:{port}{get.get('path', '/')}",
                                            headers=headers)
            return 200 <= response.status_code < 400
        if "tcpSocket" in spec:
            port = resolve_port(spec["tcpSocket"]["port"], named)
            _, writer = await asyncio.wait_for(asyncio.open_connection(pod_ip, port), timeout)
            writer.close()
            return True
    except (httpx.HTTPError, OSError, TimeoutError, ValueError):
        return False
    return False  # exec and grpc probes are not run by this node: they never pass
