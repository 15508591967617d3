"""Raw loopback socket copies: the ceilings the KV transport is compared against.

Both move `nbytes` over 127.0.0.1 with plain blocking sendall/recv_into (no framing, no
checksums, no asyncio) and return GB/s. A KV benchmark calls them in the same run as its
own transfer, so all see the same machine state.

- `PlacedCopier` / `placed_copy_gbps`: like for like with a KV handoff. A sender and a
  long-lived receiver process, each pinned to the core its worker uses, copy a source of
  `nbytes` into a destination of `nbytes` (both touched first, so no page faults are
  timed): the bytes come from memory and land in memory, as a layer's blocks do.
- `raw_copy_gbps`: the same byte count as 4 MB chunks sent again and again from one buffer
  into another, by two threads of one process on any core. Both buffers stay in the CPU
  caches, so this is the socket path's best case, above what any copy of the bytes can do.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import threading
import time

import numpy as np

CHUNK = 4 << 20  # large enough that per-call overhead does not matter
SOCKET_BUFFER = 4 << 20


def _connected_pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    for sock in (client, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    return client, server


def raw_copy_seconds(nbytes: int) -> float:
    """Seconds to move `nbytes` over loopback, first byte sent to last byte received."""
    if nbytes <= 0:
        raise ValueError(f"nbytes: must be positive, got {nbytes}")
    client, server = _connected_pair()
    source = memoryview(bytearray(min(nbytes, CHUNK)))
    sink = memoryview(bytearray(min(nbytes, CHUNK)))
    received = [0]

    def receive() -> None:
        while received[0] < nbytes:
            n = server.recv_into(sink[: min(len(sink), nbytes - received[0])])
            if n == 0:
                break
            received[0] += n

    reader = threading.Thread(target=receive, daemon=True)
    try:
        reader.start()
        start = time.perf_counter()
        left = nbytes
        while left:
            step = min(left, len(source))
            client.sendall(source[:step])
            left -= step
        reader.join(timeout=60)
        elapsed = time.perf_counter() - start
    finally:
        client.close()
        server.close()
    if received[0] != nbytes:
        raise RuntimeError(f"raw loopback copy moved {received[0]} of {nbytes} bytes")
    return elapsed


def raw_copy_gbps(nbytes: int, repeats: int = 3) -> dict:
    """Median of `repeats` copies of `nbytes`: {"bytes", "seconds", "gbps", "runs"}."""
    runs = [raw_copy_seconds(nbytes) for _ in range(repeats)]
    seconds = statistics.median(runs)
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9, "runs": runs}


def _placed_receiver(max_nbytes: int, core: int | None, pipe) -> None:
    """Serve copies until the sender hangs up: an 8-byte length, then that many bytes into
    the head of one long-lived destination, then one byte back."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    sink = np.ones(max_nbytes, dtype=np.uint8)  # touched: its pages exist before the clock starts
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    pipe.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    listener.close()
    view = memoryview(sink)
    try:
        while True:
            prefix = conn.recv(8, socket.MSG_WAITALL)
            if len(prefix) < 8:
                return
            nbytes, got = int.from_bytes(prefix, "little"), 0
            while got < nbytes:
                n = conn.recv_into(view[got : min(nbytes, got + CHUNK)])
                if n == 0:
                    return
                got += n
            conn.sendall(b"k")  # the last byte is in: the sender stops its clock
    finally:
        conn.close()


class PlacedCopier:
    """Like-for-like raw copies, as many as asked, between two long-lived processes (as a
    prefill and a decode worker are): this process's calling thread, pinned to
    `sender_core` during each copy, sends from a source of `max_nbytes` to a receiver
    process on `receiver_core`, into a destination of `max_nbytes` (both touched first, so
    no page faults are timed). Use as a context manager."""

    def __init__(self, max_nbytes: int, sender_core: int | None = None, receiver_core: int | None = None,
                 timeout_s: float = 60.0):
        if max_nbytes <= 0:
            raise ValueError(f"max_nbytes: must be positive, got {max_nbytes}")
        self.max_nbytes, self.sender_core, self.timeout_s = max_nbytes, sender_core, timeout_s
        self._source = np.random.default_rng(0).integers(0, 256, max_nbytes, dtype=np.uint8)
        ctx = multiprocessing.get_context("spawn")  # the caller may hold threads: no fork
        ours, theirs = ctx.Pipe()
        self._receiver = ctx.Process(target=_placed_receiver, args=(max_nbytes, receiver_core, theirs), daemon=True)
        self._receiver.start()
        try:
            if not ours.poll(timeout_s):
                raise TimeoutError("the raw copy's receiver did not start")
            self._sock = socket.create_connection(("127.0.0.1", ours.recv()), timeout=timeout_s)
        except BaseException:
            self._receiver.kill()
            raise
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)

    def copy_seconds(self, nbytes: int) -> float:
        """Seconds from the first byte of `nbytes` sent to the receiver's word that the last
        one arrived."""
        if not 0 < nbytes <= self.max_nbytes:
            raise ValueError(f"nbytes: must be in (0, {self.max_nbytes}], got {nbytes}")
        cores = os.sched_getaffinity(0)
        if self.sender_core is not None:
            os.sched_setaffinity(0, {self.sender_core})
        try:
            start = time.perf_counter()
            self._sock.sendall(nbytes.to_bytes(8, "little"))
            self._sock.sendall(memoryview(self._source)[:nbytes])
            if self._sock.recv(1) != b"k":
                raise RuntimeError("the raw copy's receiver stopped early")
            return time.perf_counter() - start
        finally:
            os.sched_setaffinity(0, cores)

    def close(self) -> None:
        self._sock.close()
        self._receiver.join(self.timeout_s)
        if self._receiver.is_alive():
            self._receiver.kill()

    def __enter__(self) -> PlacedCopier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def placed_copy_gbps(nbytes: int, repeats: int = 3, sender_core: int | None = None,
                     receiver_core: int | None = None, warmup: int = 1) -> dict:
    """Median of `repeats` PlacedCopier copies of `nbytes`, after `warmup` untimed ones
    (a new connection's first copies run slower): {"bytes", "seconds", "gbps", "runs"}."""
    with PlacedCopier(nbytes, sender_core, receiver_core) as copier:
        for _ in range(warmup):
            copier.copy_seconds(nbytes)
        runs = [copier.copy_seconds(nbytes) for _ in range(repeats)]
    seconds = statistics.median(runs)
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9, "runs": runs}


if __name__ == "__main__":
    import json
    import sys

    size = int(sys.argv[1]) if len(sys.argv) > 1 else 256 << 20
    print(json.dumps({"placed": placed_copy_gbps(size, sender_core=0, receiver_core=1)["gbps"],
                      "cached": raw_copy_gbps(size)["gbps"]}))
