"""Command connections from a tensor-parallel leader (rank 0) to its other ranks.

The leader listens; each rank connects, proves it holds the group's key (an HMAC of a
fresh challenge, so nothing else on the machine can feed the ranks pickles), names its
rank, and from then on receives commands as pickled objects. Every step of the
handshake has a deadline; afterwards a rank waits for commands without one, because its
leader's death closes the connection (and kills it: see launcher.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

AUTHKEY_ENV = "BATON_TP_AUTHKEY"  # hex; handed to ranks through the environment, not argv
_NONCE_BYTES = 32
_ACCEPT_POLL_S = 0.2


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        data += chunk
    return data


def _to_connection(sock: socket.socket) -> Connection:
    sock.setblocking(True)
    # a rank answers a call and reports the work it started right after: with Nagle's algorithm
    # the second small write waits for the peer's delayed ACK of the first, ~40 ms on Linux
    # (it was most of a tensor-parallel prefill's exposed KV transfer)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Connection(sock.detach())


class ControlListener:
    """The leader's end: accepts exactly one authenticated connection per rank."""

    def __init__(self, host: str = "127.0.0.1"):
        self.authkey = secrets.token_bytes(32)
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(_ACCEPT_POLL_S)
        self.address = (host, self._sock.getsockname()[1])

    def accept_ranks(self, ranks: set[int], deadline: float, check: Callable[[], None]) -> dict[int, Connection]:
        """Connections from every rank in `ranks` by `deadline` (time.monotonic); `check`
        runs between attempts and raises when waiting on is pointless (a rank died)."""
        conns: dict[int, Connection] = {}
        try:
            while set(conns) != ranks:
                check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel ranks {sorted(ranks - set(conns))} did not "
                                       "connect to their leader in time")
                try:
                    sock, _ = self._sock.accept()
                except TimeoutError:
                    continue
                rank = self._handshake(sock, deadline)
                if rank is None or rank not in ranks or rank in conns:
                    sock.close()  # a stranger, or a rank twice: ignore it
                    continue
                conns[rank] = _to_connection(sock)
        except BaseException:
            for conn in conns.values():
                conn.close()
            raise
        return conns

    def _handshake(self, sock: socket.socket, deadline: float) -> int | None:
        sock.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
        nonce = secrets.token_bytes(_NONCE_BYTES)
        try:
            sock.sendall(nonce)
            answer = _recv_exactly(sock, hashlib.sha256().digest_size + 4)
        except (OSError, ConnectionError):
            return None
        mac, rank = answer[:-4], struct.unpack("<i", answer[-4:])[0]
        expected = hmac.new(self.authkey, nonce + answer[-4:], hashlib.sha256).digest()
        return rank if hmac.compare_digest(mac, expected) else None

    def close(self) -> None:
        self._sock.close()


def connect_to_leader(address: tuple[str, int], rank: int, timeout_s: float,
                      authkey: bytes | None = None) -> Connection:
    """A rank's end: connect, answer the challenge, and return the command connection."""
    if authkey is None:
        authkey = bytes.fromhex(os.environ[AUTHKEY_ENV])
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        nonce = _recv_exactly(sock, _NONCE_BYTES)
        rank_bytes = struct.pack("<i", rank)
        sock.sendall(hmac.new(authkey, nonce + rank_bytes, hashlib.sha256).digest() + rank_bytes)
    except BaseException:
        sock.close()
        raise
    return _to_connection(sock)
