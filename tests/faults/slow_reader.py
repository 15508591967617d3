"""A client that opens a stream and does not read it: a tiny receive buffer, no reads."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit


class SlowReader:
    def __init__(self, url: str, body: dict, receive_buffer: int = 4096):
        parts = urlsplit(url)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connect
        self.sock.connect((parts.hostname, parts.port))
        self.buffer = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)  # as the kernel sized it
        payload = json.dumps(body).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % (parts.netloc.encode(), len(payload)) + payload)

    def drain(self, seconds: float = 1.0) -> bytes:
        """What the server had queued for this reader: everything that arrives within
        `seconds` of the first read (the stream's own pace adds little in that time)."""
        got = bytearray()
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                piece = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            if not piece:
                break
            got += piece
        return bytes(got)

    def close(self) -> None:
        self.sock.close()
