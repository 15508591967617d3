"""TCP transport (the portable default): payload bytes follow each LAYER header inline."""

from __future__ import annotations

import asyncio
import socket

import torch

from baton.kv.conn import FrameConn
from baton.kv.endpoint import Endpoint, parse_endpoint
from baton.kv.receiver import FrameReceiver
from baton.kv.sender import FrameSender, FrameTransfer
from baton.kv.transport import Transport
from baton.kv.wire import FrameHeader, encode_frame

_SOCKET_BUFFER = 4 << 20  # larger kernel buffers: fewer wakeups per multi-MB layer


def _no_release() -> None:
    return None


class TcpReceiver(FrameReceiver):
    inline_payloads = True
    def __init__(self, sink, *, worker_id: str, host: str = "127.0.0.1", port: int = 0, **options):
        super().__init__(sink, worker_id=worker_id, **options)
        self.host = host
        self.port = port

    @property
    def endpoint(self) -> str:
        return str(Endpoint("tcp", host=self.host, port=self.port))

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        sock.bind((self.host, self.port))
        sock.listen(64)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]  # port 0 asks the kernel for a free one
        return sock

    async def _read_payload(self, conn: FrameConn, h: FrameHeader):
        # The sink copies during write_layer (KVSink contract), so one buffer serves every layer.
        return await conn.recv_payload(h.payload_nbytes, reuse=True), _no_release

    async def _discard_payload(self, conn: FrameConn, h: FrameHeader) -> None:
        await conn.skip(h.inline_nbytes)


class TcpSender(FrameSender):
    def __init__(self, endpoint: str, **options):
        super().__init__(endpoint, **options)
        parsed = parse_endpoint(endpoint)
        if parsed.scheme != "tcp":
            raise ValueError(f"kv_endpoint: the tcp transport cannot reach {endpoint!r}")
        self._address = (parsed.host, parsed.port)

    async def _open_socket(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._address[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self._address)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _send_layer_frame(
        self, transfer: FrameTransfer, header: FrameHeader, payload: torch.Tensor
    ) -> None:
        frame = encode_frame(header, self._wire_bytes(header, payload), transfer.encoded_header(header))
        await self._conn_send_buffers(frame)


class TcpTransport(Transport):
    name = "tcp"

    def receiver(
        self, sink, *, worker_id, address="127.0.0.1:0", token=None, **options
    ) -> TcpReceiver:
        host, _, port = address.rpartition(":")
        return TcpReceiver(
            sink,
            worker_id=worker_id,
            host=host.strip("[]") or "127.0.0.1",
            port=int(port or 0),
            token=token,
            **options,
        )

    def sender(self, endpoint, *, worker_id, token=None, **options) -> TcpSender:
        return TcpSender(endpoint, worker_id=worker_id, token=token, **options)
