"""Decode-side receiver shared by the socket transports (TCP, shared memory).

Per connection: HELLO with the shared token first (anything else: ERROR and close, nothing
written), then LAYER and END frames for any number of requests. Every refusal is an ERROR
frame naming the request and the reason; only a malformed stream closes the connection.
Subclasses say how to listen and where a LAYER payload lies.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from abc import abstractmethod
from collections import OrderedDict

from baton.kv.conn import ConnectionClosed, FrameConn
from baton.kv.low_water import LOW_WATER_PATIENCE_S, low_water_bytes
from baton.kv.messages import Ack, ErrorCode, ErrorInfo, Hello, decode_control, encode_control
from baton.kv.protocol import Refusal, TransferProgress, check_ticket_usable
from baton.kv.transport import (
    KVReceiver,
    KVSink,
    LayerWrite,
    ReceiveStats,
    internal_token,
    maybe_await,
)
from baton.kv.wire import (
    MAX_REQUEST_ID_BYTES,
    PREAMBLE,
    ChecksumMismatch,
    FrameHeader,
    FrameKind,
    WireError,
    body_length,
    header_nbytes,
    verify_payload,
)

log = logging.getLogger(__name__)

# a HELLO names no blocks and no tensor: its header is the fixed part and a request id, its
# payload a token and two worker ids in JSON
MAX_HELLO_BODY_BYTES = 64 + MAX_REQUEST_ID_BYTES
MAX_HELLO_PAYLOAD_BYTES = 8192


class FrameReceiver(KVReceiver):
    # Payloads follow their header on the stream, so they can be read straight into the
    # sink's blocks, and a connection is woken once a batch of the frames due has queued
    # (TCP, kv/low_water.py; shared memory hands over a segment instead).
    inline_payloads = False

    def __init__(
        self,
        sink: KVSink,
        *,
        worker_id: str,
        token: str | None = None,
        frame_timeout: float = 30.0,  # a frame, once begun, must arrive within this
        handshake_timeout: float = 5.0,  # a new connection must have sent its HELLO by then
        max_unauthenticated: int = 64,  # connections still in their handshake, at most
        idle_timeout: float = 600.0,  # a connection with nothing to say is closed after this
        end_grace: float = 10.0,  # after END, missing (re-sent) layers must arrive within this
        sweep_interval: float = 0.2,
        max_layer_bytes: int = 4 << 30,
        remember_done: int = 4096,
        clock=time.time,
    ):
        self.sink = sink
        self.worker_id = worker_id
        self._token = internal_token(token).encode()
        self.frame_timeout = frame_timeout
        self.handshake_timeout = handshake_timeout
        self.max_unauthenticated = max_unauthenticated
        self._unauthenticated = 0
        self.refused_connections = 0
        self.idle_timeout = idle_timeout
        self.end_grace = end_grace
        self.sweep_interval = sweep_interval
        self.max_layer_bytes = max_layer_bytes
        self.clock = clock
        self._remember_done = remember_done
        self._done: OrderedDict[str, None] = OrderedDict()
        self._progress: dict[str, tuple[TransferProgress, FrameConn, float | None]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._listener: socket.socket | None = None

    # -- subclass hooks ------------------------------------------------------------------
    @abstractmethod
    def _listen(self) -> socket.socket:
        """A bound, listening, non-blocking socket."""

    @abstractmethod
    async def _read_payload(self, conn: FrameConn, h: FrameHeader):
        """Return (uint8 tensor with the payload bytes, release callback)."""

    @abstractmethod
    async def _discard_payload(self, conn: FrameConn, h: FrameHeader) -> None:
        """Drop a refused frame's payload (and anything holding it)."""

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._listener = self._listen()
        self._spawn(self._accept_loop())
        self._spawn(self._sweep_loop())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for rid in list(self._progress):
            await self._drop(rid, "receiver closed")

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            if self._unauthenticated >= self.max_unauthenticated:
                # a flood of silent connections: refuse at once rather than hold them
                self.refused_connections += 1
                sock.close()
                continue
            self._unauthenticated += 1
            self._spawn(self._serve(FrameConn(sock)))

    # -- one connection ------------------------------------------------------------------
    async def _serve(self, conn: FrameConn) -> None:
        try:
            try:
                authenticated = await self._handshake(conn)
            finally:
                self._unauthenticated -= 1
            if authenticated:
                while True:
                    async with asyncio.timeout(self.idle_timeout):
                        preamble = await conn.recv_preamble()
                    async with asyncio.timeout(self.frame_timeout):
                        await self._handle(conn, await conn.recv_header_rest(preamble))
        except (ConnectionClosed, TimeoutError, asyncio.CancelledError):
            pass
        except WireError as exc:
            await self._send_error(conn, "", ErrorInfo(ErrorCode.PROTOCOL, str(exc)))
        except Exception:  # never let one connection take the receiver down
            log.exception("kv receiver: connection failed")
        finally:
            for rid, (_, owner, _) in list(self._progress.items()):
                if owner is conn:
                    await self._drop(rid, "sender connection closed before the transfer completed")
            conn.close()

    async def _handshake(self, conn: FrameConn) -> bool:
        """HELLO with the token before anything else. Until it has been checked, a peer gets
        at most a small header and payload read into small buffers, for a few seconds."""
        async with asyncio.timeout(self.handshake_timeout):
            preamble = await conn.recv_preamble()
            body_len = body_length(preamble)
            if PREAMBLE.unpack(preamble)[2] != FrameKind.HELLO:  # (magic, version, kind, ...)
                await self._send_error(
                    conn, "", ErrorInfo(ErrorCode.AUTH, "first frame must be HELLO with the shared token")
                )
                return False
            if body_len > MAX_HELLO_BODY_BYTES:
                raise WireError(f"header: a HELLO header of {body_len} bytes (at most {MAX_HELLO_BODY_BYTES})")
            h = await conn.recv_header_rest(preamble)
            if h.payload_nbytes > MAX_HELLO_PAYLOAD_BYTES:
                raise WireError(f"payload_nbytes: a HELLO of {h.payload_nbytes} bytes (at most {MAX_HELLO_PAYLOAD_BYTES})")
            payload = await conn.recv_payload(h.payload_nbytes)
            verify_payload(h, payload.numpy())
            hello = decode_control(h, payload.numpy())
            assert isinstance(hello, Hello)
            if not hmac.compare_digest(hello.token.encode(), self._token):
                await self._send_error(conn, "", ErrorInfo(ErrorCode.AUTH, "wrong shared token"))
                return False
            if hello.worker_id != self.worker_id:
                msg = f"this is worker {self.worker_id!r}, not {hello.worker_id!r}"
                await self._send_error(conn, "", ErrorInfo(ErrorCode.WRONG_WORKER, msg))
                return False
            await self._send(conn, FrameKind.ACK, "", Ack())
            return True

    async def _handle(self, conn: FrameConn, h: FrameHeader) -> None:
        if h.kind == FrameKind.LAYER:
            await self._on_layer(conn, h)
        elif h.kind == FrameKind.END:
            await self._on_end(conn, h)
        else:
            raise WireError(f"kind: a sender may not send {h.kind.name} after HELLO")

    def _progress_for(self, conn: FrameConn, request_id: str) -> TransferProgress:
        if request_id in self._done:
            raise Refusal(ErrorCode.ALREADY_DONE, f"request {request_id!r} already completed here")
        now = self.clock()
        if request_id in self._progress:
            progress, owner, _ = self._progress[request_id]
            if owner is not conn:
                raise Refusal(
                    ErrorCode.PROTOCOL,
                    f"request {request_id!r} is being sent on another connection",
                )
            check_ticket_usable(progress.ticket, request_id, self.worker_id, now)
            return progress
        ticket = check_ticket_usable(self.sink.lookup(request_id), request_id, self.worker_id, now)
        progress = TransferProgress(ticket)
        self._progress[request_id] = (progress, conn, None)
        return progress

    async def _on_layer(self, conn: FrameConn, h: FrameHeader) -> None:
        if h.payload_nbytes > self.max_layer_bytes:
            raise WireError(f"payload_nbytes: {h.payload_nbytes} exceeds this receiver's limit")
        try:
            progress = self._progress_for(conn, h.request_id)
            progress.check_new_layer(h)
        except Refusal as refusal:
            await self._discard_payload(conn, h)
            await self._send_error(conn, h.request_id, refusal.info)
            return
        write = self._begin_direct_write(progress, h)
        if write is not None:
            if not await self._receive_into(conn, h, write):
                return
        elif not await self._receive_and_copy(conn, h, progress):
            return
        if self._progress.get(h.request_id, (None,))[0] is not progress:
            return  # dropped while we were reading (expired, receiver closing)
        progress.record_layer(h, self.clock())
        if self.inline_payloads:
            if not progress.frame_nbytes:  # every LAYER frame of a transfer has the first one's size
                progress.frame_nbytes = header_nbytes(h) + h.inline_nbytes
            self._batch_reads(conn)
        await self._maybe_complete(h.request_id)

    def _batch_reads(self, conn: FrameConn) -> None:
        """Wake this connection's reader once half of the frames due on it have queued: the
        LAYER frames its transfers under way still owe, of those heard from lately."""
        fresh = self.clock() - LOW_WATER_PATIENCE_S
        due = [(p.layers_due, p.frame_nbytes) for p, owner, _ in self._progress.values()
               if owner is conn and p.last_layer_at is not None and p.last_layer_at >= fresh]
        conn.set_low_water(low_water_bytes(due))

    def _begin_direct_write(self, progress: TransferProgress, h: FrameHeader) -> LayerWrite | None:
        """The sink's destination views for this layer, when the payload can go straight
        there; None: read it into a buffer and let the sink copy it. A sink that refuses
        here refuses in write_layer too, with the same error, on the copy path."""
        if not self.inline_payloads:
            return None
        try:
            write = self.sink.begin_layer_write(progress.ticket, h.layer)
        except Exception:
            return None
        if write is not None and sum(v.nbytes for v in write.views) != h.payload_nbytes:
            write.end(False)  # cannot happen for a frame that matches its ticket; be safe
            return None
        return write

    async def _receive_into(self, conn: FrameConn, h: FrameHeader, write: LayerWrite) -> bool:
        """Read the payload into the sink's views, checksum them; True when intact."""
        ok = False
        try:
            got = await conn.recv_into_views(write.views, checksum=True)
            ok = got == h.payload_crc
        finally:
            write.end(ok)  # on any exit: a cancel waiting for this write may free the blocks
        if not ok:
            msg = (f"checksum: layer {h.layer} of {h.request_id!r} has CRC32C {got:#010x}, "
                   f"header says {h.payload_crc:#010x}")
            await self._send_error(conn, h.request_id, ErrorInfo(ErrorCode.CHECKSUM, msg, h.layer))
        return ok

    async def _receive_and_copy(self, conn: FrameConn, h: FrameHeader, progress: TransferProgress) -> bool:
        """Read the payload into a buffer, verify it, let the sink copy it; True when stored."""
        buf, release = await self._read_payload(conn, h)
        try:
            try:
                verify_payload(h, buf.numpy())
            except ChecksumMismatch as exc:
                await self._send_error(
                    conn, h.request_id, ErrorInfo(ErrorCode.CHECKSUM, str(exc), h.layer)
                )
                return False
            try:
                tensor = buf.view(progress.ticket.torch_dtype).view(h.shape)
                await maybe_await(self.sink.write_layer(progress.ticket, h.layer, tensor))
            except Exception as exc:
                info = ErrorInfo(ErrorCode.SINK, f"could not store layer {h.layer}: {exc}", h.layer)
                await self._fail(h.request_id, info)
                return False
        finally:
            # Views of a shared-memory mapping must be gone before it can be unmapped.
            tensor = buf = None
            release()
        return True

    async def _on_end(self, conn: FrameConn, h: FrameHeader) -> None:
        payload = (await conn.recv_payload(h.payload_nbytes)).numpy()
        try:
            verify_payload(h, payload)
        except ChecksumMismatch as exc:
            await self._send_error(conn, h.request_id, ErrorInfo(ErrorCode.CHECKSUM, str(exc), -1))
            return
        end = decode_control(h, payload)
        try:
            progress = self._progress_for(conn, h.request_id)
        except Refusal as refusal:
            await self._send_error(conn, h.request_id, refusal.info)
            return
        try:
            progress.record_end(end)
        except Refusal as refusal:
            await self._fail(h.request_id, refusal.info)
            return
        self._progress[h.request_id] = (progress, conn, self.clock())
        await self._maybe_complete(h.request_id)

    async def _maybe_complete(self, request_id: str) -> None:
        if request_id not in self._progress:
            return
        progress, conn, end_at = self._progress[request_id]
        try:
            if not progress.ready_to_finish():
                return
        except Refusal as refusal:
            await self._fail(request_id, refusal.info)
            return
        stats = ReceiveStats(
            request_id=request_id,
            layers=len(progress.layer_crcs),
            total_bytes=progress.bytes_received,
            first_layer_at=progress.first_frame_at,
            last_layer_at=progress.last_layer_at,
            end_at=end_at,
        )
        end = progress.end
        del self._progress[request_id]
        try:
            await maybe_await(
                self.sink.finish(progress.ticket, end.first_token, end.logprob, stats,
                                 sampler_state=end.sampler_state)
            )
        except Exception as exc:
            await maybe_await(self.sink.abort(progress.ticket, f"finish failed: {exc}"))
            await self._send_error(
                conn, request_id, ErrorInfo(ErrorCode.SINK, f"could not start the sequence: {exc}")
            )
            return
        self._done[request_id] = None
        while len(self._done) > self._remember_done:
            self._done.popitem(last=False)
        await self._send(
            conn, FrameKind.ACK, request_id, Ack(layers=stats.layers, total_bytes=stats.total_bytes)
        )

    # -- failures and deadlines ----------------------------------------------------------
    async def _fail(self, request_id: str, info: ErrorInfo) -> None:
        """Refuse the whole transfer: tell the sender, tell the sink."""
        entry = self._progress.get(request_id)
        if entry is None:
            return
        await self._send_error(entry[1], request_id, info)
        await self._drop(request_id, f"{info.code}: {info.message}")

    async def _drop(self, request_id: str, reason: str) -> None:
        entry = self._progress.pop(request_id, None)
        if entry is not None:
            if self.inline_payloads:
                self._batch_reads(entry[1])  # its frames are no longer due
            try:
                await maybe_await(self.sink.abort(entry[0].ticket, reason))
            except Exception:
                log.exception("kv receiver: sink.abort failed for %s", request_id)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval)
            now = self.clock()
            for rid, (progress, _, end_at) in list(self._progress.items()):
                if progress.ticket.is_expired(now):
                    msg = f"ticket for request {rid!r} expired before the transfer completed"
                    await self._fail(rid, ErrorInfo(ErrorCode.EXPIRED, msg))
                elif end_at is not None and now - end_at > self.end_grace:
                    msg = f"END arrived but layers {progress.missing_layers} never did"
                    await self._fail(rid, ErrorInfo(ErrorCode.INCOMPLETE, msg))

    async def _send(self, conn: FrameConn, kind: FrameKind, request_id: str, doc) -> None:
        header, payload = encode_control(kind, request_id, doc)
        try:
            await conn.send(header, payload, timeout=self.frame_timeout)
        except (ConnectionClosed, TimeoutError):
            pass  # the sender is gone; its transfers are dropped when the connection ends

    async def _send_error(self, conn: FrameConn, request_id: str, info: ErrorInfo) -> None:
        log.info("kv receiver: refused %r: %s: %s", request_id, info.code, info.message)
        await self._send(conn, FrameKind.ERROR, request_id, info)
