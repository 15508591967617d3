"""KV endpoint addresses: `tcp://host:port`, `shm://name` (same host) and `gpu://...` (slot)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

SCHEMES = ("tcp", "shm", "gpu")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str = ""
    port: int = 0
    name: str = ""

    def __str__(self) -> str:
        if self.scheme == "tcp":
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"tcp://{host}:{self.port}"
        return f"{self.scheme}://{self.name}"


def parse_endpoint(text: object) -> Endpoint:
    """Parse and validate an endpoint string; raises ValueError saying what is wrong."""
    if not isinstance(text, str) or "://" not in text:
        raise ValueError(f"kv_endpoint: expected 'tcp://host:port' or 'shm://name', got {text!r}")
    scheme, rest = text.split("://", 1)
    if scheme not in SCHEMES:
        raise ValueError(
            f"kv_endpoint: unknown scheme {scheme!r} in {text!r}; expected {list(SCHEMES)}"
        )
    if scheme == "tcp":
        if rest.startswith("["):  # IPv6 literal
            host, _, port_text = rest[1:].partition("]:")
        else:
            host, _, port_text = rest.rpartition(":")
        if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(
                f"kv_endpoint: expected tcp://host:port with port 1..65535, got {text!r}"
            )
        return Endpoint("tcp", host=host, port=int(port_text))
    if not _NAME.match(rest):
        raise ValueError(
            f"kv_endpoint: {scheme} endpoint name must be 1-100 of [A-Za-z0-9._-], got {text!r}"
        )
    return Endpoint(scheme, name=rest)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, bracketed or not) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
