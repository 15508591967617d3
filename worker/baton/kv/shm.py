"""Same-host transport: control frames over a unix socket, payloads in /dev/shm segments.

The sender writes each layer into a fresh segment file and sends the LAYER header naming it;
the receiver maps it, verifies the checksum, hands it to the sink and removes the file. The
sender removes any of its segments still present when the transfer ends, so a crashed or
refusing receiver leaves nothing behind. Segments are created 0600: only the same user (the
worker's own account) can read them.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import re
import socket
import tempfile
import uuid
from dataclasses import replace

import torch

from baton.kv.conn import FrameConn
from baton.kv.endpoint import Endpoint, parse_endpoint
from baton.kv.receiver import FrameReceiver
from baton.kv.sender import FrameSender, FrameTransfer
from baton.kv.transport import Transport
from baton.kv.wire import FrameHeader, WireError

SEGMENT_PREFIX = "baton-kv-"
_SEGMENT_NAME = re.compile(r"^baton-kv-[0-9a-f]{16}-[0-9]{1,12}$")


def segment_dir() -> str:
    return os.environ.get("BATON_KV_SHM_DIR") or (
        "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    )


def socket_path(name: str) -> str:
    base = os.environ.get("BATON_KV_SOCKET_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"baton-kv-{name}.sock")


def _segment_path(ref: str) -> str:
    # The name comes off the wire: never let it point anywhere but our own segments.
    if not _SEGMENT_NAME.match(ref):
        raise WireError(f"ref: {ref!r} is not a Baton shared-memory segment name")
    return os.path.join(segment_dir(), ref)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmReceiver(FrameReceiver):
    def __init__(self, sink, *, worker_id: str, name: str, **options):
        super().__init__(sink, worker_id=worker_id, **options)
        parse_endpoint(f"shm://{name}")
        self.name = name
        self.path = socket_path(name)

    @property
    def endpoint(self) -> str:
        return str(Endpoint("shm", name=self.name))

    def _listen(self) -> socket.socket:
        _unlink(self.path)  # a stale socket file from a crashed worker blocks bind()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(64)
        sock.setblocking(False)
        return sock

    async def close(self) -> None:
        await super().close()
        _unlink(self.path)

    async def _read_payload(self, conn: FrameConn, h: FrameHeader):
        if not h.ref:
            raise WireError("ref: shared-memory LAYER frames must name their segment")
        path = _segment_path(h.ref)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise WireError(f"ref: cannot open segment {h.ref!r}: {exc}") from None
        try:
            if os.fstat(fd).st_size != h.payload_nbytes:
                _unlink(path)
                raise WireError(f"ref: segment {h.ref!r} is not {h.payload_nbytes} bytes")
            # Populate up front: one call instead of a fault per page while the sink copies.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, h.payload_nbytes, flags=flags)
        finally:
            os.close(fd)
        buf = torch.frombuffer(mapping, dtype=torch.uint8)

        def release() -> None:
            nonlocal buf
            buf = None
            try:
                mapping.close()
            except BufferError:
                pass  # the sink kept a view (against the contract); unmapped when it drops it
            _unlink(path)

        return buf, release

    async def _discard_payload(self, conn: FrameConn, h: FrameHeader) -> None:
        if h.ref:
            _unlink(_segment_path(h.ref))


class ShmSender(FrameSender):
    def __init__(self, endpoint: str, **options):
        super().__init__(endpoint, **options)
        parsed = parse_endpoint(endpoint)
        if parsed.scheme != "shm":
            raise ValueError(f"kv_endpoint: the shm transport cannot reach {endpoint!r}")
        self._path = socket_path(parsed.name)
        self._prefix = f"{SEGMENT_PREFIX}{uuid.uuid4().hex[:16]}-"
        self._counter = 0
        self._segments: dict[str, set[str]] = {}  # request id -> segment paths not yet removed

    async def _open_socket(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self._path)
        except BaseException:
            sock.close()
            raise
        return sock

    def _write_segment(self, views: list[memoryview]) -> str:
        """A fresh segment holding the views laid end to end."""
        self._counter += 1
        name = f"{self._prefix}{self._counter}"
        path = os.path.join(segment_dir(), name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            # write() fills tmpfs pages in bulk; writing through a fresh mmap would take a
            # page fault per 4 KiB.
            for view in views:
                written = 0
                while written < view.nbytes:
                    written += os.write(fd, view[written:])
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        return name

    async def _send_layer_frame(
        self, transfer: FrameTransfer, header: FrameHeader, payload: torch.Tensor
    ) -> None:
        rid = transfer.ticket.request_id
        name = self._write_segment(self._wire_bytes(header, payload))
        path = os.path.join(segment_dir(), name)
        self._segments.setdefault(rid, set()).add(path)
        try:
            await self._conn_send(_with_ref(header, name))
        except BaseException:
            _unlink(path)
            raise

    def _forget(self, transfer: FrameTransfer) -> None:
        super()._forget(transfer)
        for path in self._segments.pop(transfer.ticket.request_id, ()):
            _unlink(path)


def _with_ref(header: FrameHeader, ref: str) -> FrameHeader:
    return replace(header, ref=ref)


class ShmTransport(Transport):
    name = "shm"

    def receiver(self, sink, *, worker_id, address, token=None, **options) -> ShmReceiver:
        return ShmReceiver(sink, worker_id=worker_id, name=address, token=token, **options)

    def sender(self, endpoint, *, worker_id, token=None, **options) -> ShmSender:
        return ShmSender(endpoint, worker_id=worker_id, token=token, **options)
