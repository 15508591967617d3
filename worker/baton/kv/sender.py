"""Prefill-side sender shared by the socket transports (TCP, shared memory).

One connection per decode worker, shared by all transfers to it. A reader task routes the
receiver's ACK and ERROR frames to the transfer they name. A CHECKSUM refusal re-sends that
layer from the kept copy (bounded); any other refusal fails the transfer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable

import torch

from baton.kv.blockviews import ViewPayload, checksum_views
from baton.kv.conn import ConnectionClosed, FrameConn
from baton.kv.messages import (
    RETRYABLE,
    Ack,
    EndSummary,
    ErrorInfo,
    Hello,
    decode_control,
    encode_control,
)
from baton.kv.ticket import Ticket
from baton.kv.transport import (
    KVSender,
    KVTransfer,
    TransferError,
    TransferRefused,
    TransferTimeout,
    internal_token,
)
from baton.kv.wire import (
    FrameHeader,
    FrameKind,
    LayerHeaders,
    WireError,
    encode_frame,
    encode_header,
    layer_header,
    payload_views,
    verify_payload,
)

log = logging.getLogger(__name__)

# Fault injection for tests: given a LAYER header and its bytes, return the bytes to ship.
WireHook = Callable[[FrameHeader, memoryview], object]


class FrameTransfer(KVTransfer):
    def __init__(self, sender: FrameSender, ticket: Ticket):
        self.sender = sender
        self.ticket = ticket
        self._payloads: dict[int, torch.Tensor | ViewPayload] = {}
        self._crcs: dict[int, int] = {}
        self._resends: Counter[int] = Counter()
        self._resending: set[asyncio.Task] = set()  # awaited by abort(): payloads may be views
        self._done = asyncio.get_running_loop().create_future()
        self._failure: TransferError | None = None
        self._closed = False
        self.sent_at: dict[int, tuple[float, float]] = {}  # layer -> (start, end), perf_counter
        self.resent_layers: list[int] = []
        used = -(-ticket.num_tokens // ticket.block_size)
        self._headers = LayerHeaders(ticket.request_id, ticket.block_ids[:used], ticket.layer_payload_shape,
                                     ticket.dtype, head_start=ticket.head_start)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise TransferError(f"transfer for {self.ticket.request_id!r} is closed")

    async def send_layer(self, layer: int, payload: torch.Tensor | ViewPayload) -> None:
        """`payload` is a tensor or a ViewPayload of cache blocks; a ViewPayload's memory
        must stay unchanged until this transfer ends (ACK or abort), for re-sends."""
        self._raise_if_failed()
        t = self.ticket
        if not 0 <= layer < t.num_layers:
            raise ValueError(f"layer: {layer} is outside [0, {t.num_layers})")
        if layer in self._payloads:
            raise ValueError(f"layer: {layer} was already sent for {t.request_id!r}")
        if tuple(payload.shape) != t.layer_payload_shape or payload.dtype != t.torch_dtype:
            raise ValueError(
                f"payload: expected {t.layer_payload_shape} {t.dtype}, got {tuple(payload.shape)} {payload.dtype}"
            )
        if isinstance(payload, torch.Tensor):
            payload = payload.contiguous()
        self._payloads[layer] = payload  # kept until ACK: a corrupted layer is re-sent from here
        start = time.perf_counter()
        header = await self._ship(layer, payload)
        self._crcs[layer] = header.payload_crc
        self.sent_at[layer] = (start, time.perf_counter())

    async def _ship(self, layer: int, payload) -> FrameHeader:
        if tuple(payload.shape) == self._headers.template.shape:
            header = self._headers.header(layer, checksum_views(payload_views(payload)))
        else:  # send_layer refuses such a payload; a caller that skips it (a bad peer) gets here
            header = layer_header(self.ticket.request_id, layer, self._headers.template.block_ids,
                                  payload, head_start=self.ticket.head_start)
        await self.sender._send_layer_frame(self, header, payload)
        return header

    def encoded_header(self, header: FrameHeader) -> bytes:
        """A header from _ship as wire bytes."""
        if header.shape == self._headers.template.shape:
            return self._headers.encode(header.layer, header.payload_crc)
        return encode_header(header)

    async def _resend(self, layer: int) -> None:
        try:
            self._raise_if_failed()
            self.resent_layers.append(layer)
            await self._ship(layer, self._payloads[layer])
        except TransferError:
            pass
        except Exception as exc:
            self._fail(TransferError(f"re-sending layer {layer} failed: {exc}"))

    async def finish(
        self, first_token: int, logprob: float | None = None, timeout: float = 30.0,
        sampler_state: str | None = None,
    ) -> Ack:
        try:
            self._raise_if_failed()
            missing = [i for i in range(self.ticket.num_layers) if i not in self._crcs]
            if missing:
                raise ValueError(f"finish: layers {missing} were never sent")
            end = EndSummary(
                first_token=first_token,
                total_bytes=self.ticket.total_payload_nbytes,
                layer_checksums=[self._crcs[i] for i in range(self.ticket.num_layers)],
                logprob=logprob,
                sampler_state=sampler_state,
            )
            header, body = encode_control(FrameKind.END, self.ticket.request_id, end)
            try:
                async with asyncio.timeout(timeout):
                    await self.sender._conn_send(header, body)
                    return await asyncio.shield(self._done)
            except TimeoutError:
                raise TransferTimeout(
                    f"no ACK for {self.ticket.request_id!r} within {timeout}s "
                    f"(resent layers: {self.resent_layers})"
                ) from None
        finally:
            await self.abort()

    async def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self.sender._forget(self)
            if not self._done.done():
                self._done.cancel()
        # A re-send in progress still reads its payload (maybe the prefill's own blocks):
        # the caller may free that memory only once it is done.
        pending = [task for task in self._resending if not task.done()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self._payloads.clear()  # release the prefill copy

    # -- called by the sender's reader ---------------------------------------------------
    def _on_ack(self, ack: Ack) -> None:
        if not self._done.done():
            self._done.set_result(ack)

    def _on_error(self, info: ErrorInfo) -> None:
        layer = info.layer
        if info.code in RETRYABLE and layer in self._payloads:
            if self._resends[layer] < self.sender.max_resends:
                self._resends[layer] += 1
                task = self.sender._spawn(self._resend(layer))
                self._resending.add(task)
                task.add_done_callback(self._resending.discard)
                return
            info = ErrorInfo(
                info.code,
                f"{info.message} (gave up after {self.sender.max_resends} re-sends)",
                layer,
            )
        self._fail(TransferRefused(info))

    def _fail(self, exc: TransferError) -> None:
        if self._failure is None:
            self._failure = exc
        if not self._done.done():
            self._done.set_exception(exc)
            self._done.exception()  # marks it retrieved: no "never retrieved" warning


class FrameSender(KVSender):
    def __init__(
        self,
        endpoint: str,
        *,
        worker_id: str,
        token: str | None = None,
        sender_id: str = "",
        connect_timeout: float = 5.0,
        frame_timeout: float = 30.0,
        max_resends: int = 3,
        on_wire: WireHook | None = None,
    ):
        self.endpoint = endpoint
        self.worker_id = worker_id
        self._token = internal_token(token)
        self.sender_id = sender_id
        self.connect_timeout = connect_timeout
        self.frame_timeout = frame_timeout
        self.max_resends = max_resends
        self.on_wire = on_wire
        self._conn: FrameConn | None = None
        self._connecting = asyncio.Lock()
        self._transfers: dict[str, FrameTransfer] = {}
        self._tasks: set[asyncio.Task] = set()

    @abstractmethod
    async def _open_socket(self) -> socket.socket: ...

    @abstractmethod
    async def _send_layer_frame(
        self, transfer: FrameTransfer, header: FrameHeader, payload: torch.Tensor | ViewPayload
    ) -> None:
        """Put one LAYER frame (and its payload) on the way to the receiver."""

    def _wire_bytes(self, header: FrameHeader, payload) -> list[memoryview]:
        """The payload's byte views in wire order (through the test hook when one is set)."""
        views = payload_views(payload)
        if self.on_wire is None:
            return views
        joined = views[0] if len(views) == 1 else memoryview(b"".join(views))
        return payload_views(self.on_wire(header, joined))

    # -- connection ----------------------------------------------------------------------
    async def _connection(self) -> FrameConn:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        async with self._connecting:
            if self._conn is None or self._conn.closed:
                self._conn = await self._connect()
            return self._conn

    async def _connect(self) -> FrameConn:
        try:
            async with asyncio.timeout(self.connect_timeout):
                conn = FrameConn(await self._open_socket())
                hello = Hello(token=self._token, worker_id=self.worker_id, sender_id=self.sender_id)
                await conn.send(
                    *encode_control(FrameKind.HELLO, "", hello), timeout=self.frame_timeout
                )
                h = await conn.recv_header()
                reply = await self._read_control(conn, h)
        except TimeoutError:
            raise TransferTimeout(
                f"{self.endpoint}: no answer to HELLO within {self.connect_timeout}s"
            ) from None
        except (OSError, ConnectionClosed) as exc:
            raise TransferError(f"{self.endpoint}: cannot connect: {exc}") from exc
        if h.kind == FrameKind.ERROR:
            conn.close()
            raise TransferRefused(reply)
        if h.kind != FrameKind.ACK:
            conn.close()
            raise TransferError(f"{self.endpoint}: expected ACK to HELLO, got {h.kind.name}")
        self._spawn(self._read_loop(conn))
        return conn

    async def _read_control(self, conn: FrameConn, h: FrameHeader):
        payload = (await conn.recv_payload(h.payload_nbytes)).numpy()
        verify_payload(h, payload)
        return decode_control(h, payload)

    async def _read_loop(self, conn: FrameConn) -> None:
        reason = "connection closed"
        try:
            while True:
                h = await conn.recv_header()
                async with asyncio.timeout(self.frame_timeout):
                    doc = await self._read_control(conn, h)
                transfer = self._transfers.get(h.request_id)
                if transfer is None:
                    if h.kind == FrameKind.ERROR and not h.request_id:
                        reason = f"receiver closed the connection: {doc.code}: {doc.message}"
                        break
                    continue  # late answer for a transfer that already ended
                if h.kind == FrameKind.ACK:
                    transfer._on_ack(doc)
                elif h.kind == FrameKind.ERROR:
                    transfer._on_error(doc)
        except (ConnectionClosed, TimeoutError, WireError) as exc:
            reason = f"connection to {self.endpoint} lost: {exc}"
        except asyncio.CancelledError:
            reason = "sender closed"
        finally:
            conn.close()
            for transfer in list(self._transfers.values()):
                transfer._fail(TransferError(reason))

    async def _conn_send(self, header: FrameHeader, payload=b"") -> None:
        await self._conn_send_buffers(encode_frame(header, payload))

    async def _conn_send_buffers(self, buffers: list) -> None:
        """Write one encoded frame (header bytes, then its payload's views)."""
        conn = await self._connection()
        try:
            await conn.send_buffers(buffers, timeout=self.frame_timeout)
        except (ConnectionClosed, TimeoutError) as exc:
            raise TransferError(f"sending to {self.endpoint} failed: {exc}") from exc

    # -- transfers -----------------------------------------------------------------------
    async def open(self, ticket: Ticket) -> FrameTransfer:
        if ticket.worker_id != self.worker_id:
            raise ValueError(
                f"worker_id: ticket is for {ticket.worker_id!r}, this sender reaches {self.worker_id!r}"
            )
        if ticket.request_id in self._transfers:
            raise ValueError(f"request_id: a transfer for {ticket.request_id!r} is already open")
        await self._connection()
        transfer = FrameTransfer(self, ticket)
        self._transfers[ticket.request_id] = transfer
        return transfer

    def _forget(self, transfer: FrameTransfer) -> None:
        if self._transfers.get(transfer.ticket.request_id) is transfer:
            del self._transfers[transfer.ticket.request_id]

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for transfer in list(self._transfers.values()):
            transfer._fail(TransferError("sender closed"))
            await transfer.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._conn is not None:
            self._conn.close()
