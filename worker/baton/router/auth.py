"""The client API key: one comparison, in constant time, for every protected route."""

from __future__ import annotations

import hmac
import ipaddress

from baton.router.asgi_io import header


def expected_header(api_key: str | None) -> bytes | None:
    return f"Bearer {api_key}".encode() if api_key else None


def authorized(scope: dict, expected: bytes | None) -> bool:
    """True when no key is set or the request carries it. compare_digest takes as long
    for a near miss as for a wild guess, so timing tells an attacker nothing."""
    if expected is None:
        return True
    given = header(scope, b"authorization")
    return given is not None and hmac.compare_digest(given, expected)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or a wildcard: assume others can reach it
