"""Raw loopback socket copy: the ceiling the KV transport is compared against.

`raw_copy_gbps(nbytes)` moves `nbytes` from one socket to another on 127.0.0.1 with plain
blocking sendall/recv_into (no framing, no checksums, no asyncio) and returns GB/s. A KV
benchmark calls it in the same run as its own transfer, so both see the same machine state.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time

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


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(raw_copy_gbps(int(sys.argv[1]) if len(sys.argv) > 1 else 256 << 20)))
