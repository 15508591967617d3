"""Frames over a non-blocking stream socket (TCP or unix), without copying payloads.

asyncio's StreamWriter copies whatever the kernel does not take at once into its own buffer,
and StreamReader.readexactly returns fresh bytes copied out of another buffer. Here a frame
goes out with one sendmsg() of [header, payload view] and comes in with recv_into() straight
into the destination buffer.
"""

from __future__ import annotations

import asyncio
import socket

import crc32c
import torch

from baton.kv.blockviews import IOV_MAX
from baton.kv.low_water import LOW_WATER_PATIENCE_S
from baton.kv.wire import PREAMBLE_SIZE, FrameHeader, body_length, decode_header, encode_frame

_SKIP_CHUNK = 1 << 20


class ConnectionClosed(ConnectionError):
    pass


def _checksum_filled(views: list[memoryview], first: int, nbytes: int, crc: int) -> int:
    """Extend `crc` over the `nbytes` just written from views[first] on."""
    i = first
    while nbytes:
        piece = views[i] if views[i].nbytes <= nbytes else views[i][:nbytes]
        crc = crc32c.crc32c(piece, value=crc)
        nbytes -= piece.nbytes
        i += 1
    return crc


def _advance(views: list[memoryview], first: int, nbytes: int) -> int:
    """Account for `nbytes` moved from views[first:]: drop the filled ones, cut the next.
    Returns the index of the first view with bytes left."""
    while nbytes:
        if nbytes >= views[first].nbytes:
            nbytes -= views[first].nbytes
            first += 1
        else:
            views[first] = views[first][nbytes:]
            nbytes = 0
    return first


class FrameConn:
    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Control frames are tiny; Nagle + delayed ACK would add tens of ms to each.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._send_lock = asyncio.Lock()
        self._waiters: set[asyncio.Future] = set()
        self._rx = torch.empty(0, dtype=torch.uint8)
        self.closed = False
        self.bytes_read = 0
        self.low_water = 1  # queued bytes that make the socket readable (SO_RCVLOWAT)
        self._patience: asyncio.TimerHandle | None = None

    # -- sending -------------------------------------------------------------------------
    async def send(self, header: FrameHeader, payload=b"", timeout: float = 30.0) -> None:
        """Write one frame atomically with respect to other senders on this connection."""
        await self.send_buffers(encode_frame(header, payload), timeout)

    async def send_buffers(self, buffers: list, timeout: float = 30.0) -> None:
        """Write one already encoded frame (header bytes, payload views), like send()."""
        async with self._send_lock:
            try:
                views = [memoryview(b).cast("B") for b in buffers if len(b)]
                first = self._sendmsg_now(views, 0)  # usually the whole frame: no timer needed
                if first < len(views):
                    async with asyncio.timeout(timeout):
                        await self._sendmsg_all(views, first)
            except BaseException:
                # A half-written frame leaves the stream unusable.
                self.close()
                raise

    def _sendmsg_now(self, views: list[memoryview], first: int) -> int:
        """Send what the socket takes without waiting; returns the first view with bytes left
        (views[:first] are on their way)."""
        while first < len(views):
            if self.closed:
                raise ConnectionClosed("connection closed while sending")
            try:
                sent = self.sock.sendmsg(views[first : first + IOV_MAX])
            except (BlockingIOError, InterruptedError):
                return first
            except OSError as exc:
                raise ConnectionClosed(f"send failed: {exc}") from exc
            first = _advance(views, first, sent)
        return first

    async def _sendmsg_all(self, views: list[memoryview], first: int) -> None:
        while first < len(views):
            await self._wait_writable()
            first = self._sendmsg_now(views, first)

    async def _wait_ready(self, add, remove) -> None:
        """Wait until the socket is readable/writable; close() wakes every waiter."""
        if self.closed:
            raise ConnectionClosed("connection closed")
        fut = self.loop.create_future()
        fd = self.sock.fileno()
        add(fd, lambda: fut.done() or fut.set_result(None))
        self._waiters.add(fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)
            if not self.closed:
                remove(fd)

    async def _wait_writable(self) -> None:
        await self._wait_ready(self.loop.add_writer, self.loop.remove_writer)

    # -- receiving -----------------------------------------------------------------------
    async def recv_into(self, view: memoryview) -> None:
        await self.recv_into_views([view.cast("B") if view.format != "B" else view])

    async def recv_into_views(self, views: list[memoryview], checksum: bool = False) -> int:
        """Fill the byte views in order, as if they were one buffer (one recvmsg_into call
        fills many of them: a layer spread over block runs costs no extra system calls).
        With `checksum`, returns the CRC32C of the bytes, taken as each piece lands (while
        it is still in the CPU cache; a second pass over a multi-MB layer reads it back from
        memory). The caller's list is left as it was."""
        views = [v for v in views if v.nbytes]
        first, crc, got = 0, 0, 0
        while first < len(views):
            if self.closed:
                raise ConnectionClosed("connection closed")
            try:
                n = self.sock.recvmsg_into(views[first : first + IOV_MAX])[0]
            except (BlockingIOError, InterruptedError):
                await self._wait_ready(self.loop.add_reader, self.loop.remove_reader)
                continue
            except OSError as exc:
                raise ConnectionClosed(f"receive failed: {exc}") from exc
            if n == 0:
                raise ConnectionClosed("peer closed the connection" + (" mid-frame" if got else ""))
            got += n
            self.bytes_read += n
            if checksum:
                crc = _checksum_filled(views, first, n, crc)
            first = _advance(views, first, n)
        return crc

    async def recv_preamble(self) -> bytes:
        """Wait (without a deadline of its own) for the next frame to start."""
        pre = bytearray(PREAMBLE_SIZE)
        await self.recv_into(memoryview(pre))
        return bytes(pre)

    async def recv_header_rest(self, preamble: bytes) -> FrameHeader:
        body = bytearray(body_length(preamble))
        await self.recv_into(memoryview(body))
        return decode_header(preamble + body)

    async def recv_header(self) -> FrameHeader:
        return await self.recv_header_rest(await self.recv_preamble())

    async def recv_payload(self, nbytes: int, reuse: bool = False) -> torch.Tensor:
        """Read `nbytes` into a uint8 tensor. With `reuse`, the connection's own buffer is
        used again and again (valid until the next read): fresh multi-MB allocations cost
        page faults on every layer."""
        if reuse:
            if self._rx.numel() < nbytes:
                self._rx = torch.empty(nbytes, dtype=torch.uint8)
            buf = self._rx[:nbytes]
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8)  # uninitialised: no memset first
        if nbytes:
            await self.recv_into(memoryview(buf.numpy()))
        return buf

    async def skip(self, nbytes: int) -> None:
        """Consume and drop bytes of a refused frame, keeping the stream in step."""
        scratch = memoryview(bytearray(min(nbytes, _SKIP_CHUNK)))
        while nbytes:
            step = min(nbytes, len(scratch))
            await self.recv_into(scratch[:step])
            nbytes -= step

    # -- waking in batches (kv/low_water.py) ---------------------------------------------
    def set_low_water(self, nbytes: int, patience_s: float = LOW_WATER_PATIENCE_S) -> None:
        """Be woken only once `nbytes` are queued (SO_RCVLOWAT; 1: any byte). The caller
        must know at least that many are coming. If nothing is read for `patience_s` while
        it is above 1 (a sender stopped short), it goes back to 1."""
        if nbytes == self.low_water or self.closed:
            return
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        except OSError:
            return  # a socket that does not take it is read as bytes come
        self.low_water = nbytes
        if nbytes > 1 and self._patience is None:
            self._patience = self.loop.call_later(patience_s, self._check_patience, self.bytes_read, patience_s)

    def _check_patience(self, read_before: int, patience_s: float) -> None:
        self._patience = None
        if self.low_water <= 1 or self.closed:
            return
        if self.bytes_read == read_before:
            self.set_low_water(1)
            # look again under the lower mark now: Linux signals a waiting reader itself when
            # the mark drops below what is queued, not every kernel does (a woken writer
            # just finds its socket still full and waits again)
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(None)
        else:
            self._patience = self.loop.call_later(patience_s, self._check_patience, self.bytes_read, patience_s)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._patience is not None:
                self._patience.cancel()
                self._patience = None
            fd = self.sock.fileno()
            if fd >= 0:
                self.loop.remove_reader(fd)
                self.loop.remove_writer(fd)
            for fut in self._waiters:
                if not fut.done():
                    fut.set_exception(ConnectionClosed("connection closed"))
            try:
                self.sock.close()
            except OSError:
                pass
