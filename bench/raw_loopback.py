"""Raw loopback socket copies: the ceilings the KV transport is compared against.

Both move `nbytes` over 127.0.0.1 with plain blocking sendall/recv_into (no framing, no
checksums, no asyncio) and return GB/s. A KV benchmark calls them in the same run as its
own transfer, so all see the same machine state.

- `placed_copy_gbps`: like for like with a KV handoff. A sender and a receiver process,
  each pinned to the core its worker uses, copy a source of `nbytes` into a destination of
  `nbytes` (both touched first, so no page faults are timed): the bytes come from memory
  and land in memory, as a layer's blocks do.
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


def _placed_receiver(nbytes: int, repeats: int, core: int | None, pipe) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    sink = np.ones(nbytes, dtype=np.uint8)  # touched: its pages exist before the clock starts
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    pipe.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    listener.close()
    view = memoryview(sink)
    try:
        for _ in range(repeats):
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got : got + CHUNK])
                if n == 0:
                    return
                got += n
            conn.sendall(b"k")  # the last byte is in: the sender stops its clock
    finally:
        conn.close()


def placed_copy_gbps(nbytes: int, repeats: int = 3, sender_core: int | None = None,
                     receiver_core: int | None = None, timeout_s: float = 60.0) -> dict:
    """Median of `repeats` copies of `nbytes` from this process (its calling thread pinned to
    `sender_core` while it runs) to a receiver process on `receiver_core`, first byte sent
    to the receiver's word that the last one arrived: {"bytes", "seconds", "gbps", "runs"}."""
    if nbytes <= 0:
        raise ValueError(f"nbytes: must be positive, got {nbytes}")
    ctx = multiprocessing.get_context("spawn")  # the caller may hold threads: no fork
    ours, theirs = ctx.Pipe()
    receiver = ctx.Process(target=_placed_receiver, args=(nbytes, repeats, receiver_core, theirs), daemon=True)
    receiver.start()
    cores = os.sched_getaffinity(0)
    source = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    runs = []
    try:
        if not ours.poll(timeout_s):
            raise TimeoutError("the raw copy's receiver did not start")
        sock = socket.create_connection(("127.0.0.1", ours.recv()), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        if sender_core is not None:
            os.sched_setaffinity(0, {sender_core})
        with sock:
            for _ in range(repeats):
                start = time.perf_counter()
                sock.sendall(memoryview(source))
                if sock.recv(1) != b"k":
                    raise RuntimeError("the raw copy's receiver stopped early")
                runs.append(time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, cores)
        receiver.join(timeout_s)
        if receiver.is_alive():
            receiver.kill()
    seconds = statistics.median(runs)
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9, "runs": runs}


if __name__ == "__main__":
    import json
    import sys

    size = int(sys.argv[1]) if len(sys.argv) > 1 else 256 << 20
    print(json.dumps({"placed": placed_copy_gbps(size, sender_core=0, receiver_core=1)["gbps"],
                      "cached": raw_copy_gbps(size)["gbps"]}))
