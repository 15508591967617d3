"""Loopback addresses for pods and Services (pure).

All of 127.0.0.0/8 reaches the loopback interface on Linux, so each pod can own an address
without any network setup. Pods take 127.0.x.y from a base third octet up, Services take
theirs from another range; an address is reused only after every other one was handed out.
"""

from __future__ import annotations

import ipaddress


class AddressPool:
    def __init__(self, first: str, last: str) -> None:
        self._first = int(ipaddress.IPv4Address(first))
        self._last = int(ipaddress.IPv4Address(last))
        self._next = self._first
        self._taken: set[int] = set()

    @property
    def size(self) -> int:
        return self._last - self._first + 1

    def allocate(self) -> str:
        for _ in range(self.size):
            candidate = self._next
            self._next = self._first if self._next >= self._last else self._next + 1
            if candidate in self._taken or (candidate & 0xFF) in (0, 255):
                continue  # .0 and .255 look like network and broadcast addresses to people
            self._taken.add(candidate)
            return str(ipaddress.IPv4Address(candidate))
        raise RuntimeError("address pool exhausted")

    def release(self, address: str) -> None:
        self._taken.discard(int(ipaddress.IPv4Address(address)))

    def taken(self) -> set[str]:
        return {str(ipaddress.IPv4Address(a)) for a in self._taken}


def cluster_pools(block: int) -> tuple[AddressPool, AddressPool]:
    """Pods get 127.0.<32*block + 0..15>.y, Services 127.0.<32*block + 16..31>.y: clusters with
    different blocks (1..7) can run side by side, and none touches 127.0.0.x."""
    if not 1 <= block <= 7:
        raise ValueError("block must be 1..7")
    base = 32 * block
    return (AddressPool(f"127.0.{base}.1", f"127.0.{base + 15}.254"),
            AddressPool(f"127.0.{base + 16}.1", f"127.0.{base + 31}.254"))
