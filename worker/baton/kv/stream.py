"""Prefill side: ship each layer's KV while the next layer computes.

The model calls `on_layer_done(layer, k_cache, v_cache)` from its compute thread right after
a layer has written its KV. The streamer queues that layer's slice to a sender running on an
event loop in another thread, which puts it on the wire while the next layer computes.

The slice goes out straight from the cache blocks (byte views, no copy) when they allow it
(CPU cache, all heads: see blockviews.py) and the caller promises the blocks stay untouched
until the transfer is over (`blocks_stable`; it waits for `closed()` before freeing them).
Otherwise it is copied first, so compute may go on and even reuse the blocks.
`finish(first_token)` sends END and waits for the receiver's ACK. Timestamps per layer let
the overlap be measured, not assumed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field

import torch

from baton.kv.blockviews import view_payload
from baton.kv.buffers import SEND_BUFFERS, BufferPool
from baton.kv.layout import gather_layer
from baton.kv.messages import Ack
from baton.kv.ticket import Ticket
from baton.kv.transport import KVSender, TransferError, TransferTimeout

_DONE = object()


class BackgroundLoop:
    """An asyncio loop on its own thread, for callers (the compute thread) that have none."""

    def __init__(self, name: str = "baton-kv-sender"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the loop and wait for its result from this thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class LayerTiming:
    compute_end: float  # on_layer_done called (layer computed)
    gathered: float  # copy of the layer taken
    send_start: float = 0.0
    send_end: float = 0.0  # last byte handed to the kernel / segment written


@dataclass
class StreamReport:
    request_id: str
    total_bytes: int
    layers: dict[int, LayerTiming] = field(default_factory=dict)
    compute_end: float = 0.0  # finish() called: prefill done, first token sampled
    ack_at: float = 0.0
    resent_layers: list[int] = field(default_factory=list)
    ack: Ack | None = None

    @property
    def transfer_seconds(self) -> float:
        """First layer handed to the sender to ACK: the whole transfer's span."""
        return self.ack_at - min(t.send_start for t in self.layers.values())

    @property
    def exposed_seconds(self) -> float:
        """What the transfer added after compute ended (ACK minus end of prefill)."""
        return max(0.0, self.ack_at - self.compute_end)

    @property
    def overlapped_layers(self) -> int:
        """Layers whose sending finished before compute ended."""
        return sum(1 for t in self.layers.values() if t.send_end <= self.compute_end)


class LayerStreamer:
    """One request's prefill-side stream. Thread-safe for one compute thread."""

    def __init__(
        self,
        ticket: Ticket,
        sender: KVSender,
        loop: asyncio.AbstractEventLoop,
        *,
        src_block_ids,
        src_block_size: int,
        clock=time.perf_counter,
        buffers: BufferPool = SEND_BUFFERS,
        blocks_stable: bool = False,
        src_head_base: int = 0,
    ):
        """`src_block_ids`/`src_block_size`: where the prompt's KV lies in *this* worker's
        cache; the ticket says where it goes on the receiver. `loop` runs `sender` on
        another thread (BackgroundLoop().loop, or the worker server's own loop).
        `blocks_stable`: the caller guarantees nothing writes those blocks of a layer once
        it is reported, and keeps them until `closed()` is done; the layers then go out
        from the blocks themselves, without a copy. `src_head_base`: the first model head
        this worker's cache holds (a tensor-parallel rank's shard); the ticket names model
        heads."""
        self.ticket = ticket
        self.sender = sender
        self.loop = loop
        self.src_block_ids = list(src_block_ids)
        self.src_block_size = src_block_size
        self.clock = clock
        self.report = StreamReport(ticket.request_id, ticket.total_payload_nbytes)
        self._pool = buffers
        self._buffers: list[torch.Tensor] = []  # back to the pool once the transfer is over
        self._queue: asyncio.Queue | None = None
        self._queue_ready = threading.Event()
        self.blocks_stable = blocks_stable
        self.src_head_base = src_head_base
        self._aborted = False
        self._transfer = None  # the open transfer, on the loop
        self._error: BaseException | None = None
        self._run_future = asyncio.run_coroutine_threadsafe(self._run(), loop)

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def on_layer_done(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Called on the compute thread after `layer` wrote its KV. Returns quickly."""
        compute_end = self.clock()
        if self._error is not None:
            return  # the transfer already failed; finish() will say why, compute goes on
        t = self.ticket
        base = self.src_head_base
        args = (self.src_block_ids, self.src_block_size, t.num_tokens, t.head_start - base, t.head_end - base)
        payload = view_payload(k_cache, v_cache, *args, t.layer_payload_shape) if self.blocks_stable else None
        if payload is None:
            payload = self._gather(k_cache, v_cache, args)
        self.report.layers[layer] = LayerTiming(compute_end=compute_end, gathered=self.clock())
        self._put((layer, payload))

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, args) -> torch.Tensor:
        out = self._pool.acquire(self.ticket.layer_payload_shape, k_cache.dtype)
        self._buffers.append(out)
        if k_cache.device.type == "cpu":
            return gather_layer(k_cache, v_cache, *args, out=out)
        return out.copy_(gather_layer(k_cache, v_cache, *args))  # the sockets send from host memory

    def finish(
        self, first_token: int, logprob: float | None = None, timeout: float = 30.0,
        sampler_state: str | None = None,
    ) -> StreamReport:
        """Send END after the queued layers and block until ACK (or raise TransferError)."""
        future = self.finish_async(first_token, logprob, timeout, sampler_state)
        try:
            # Generous outer bound: queued layers still have to go out before END.
            return future.result(2 * timeout + 5.0)
        except concurrent.futures.TimeoutError:
            raise TransferTimeout(
                f"no ACK for {self.ticket.request_id!r} within {timeout}s"
            ) from None

    def finish_async(
        self, first_token: int, logprob: float | None = None, timeout: float = 30.0,
        sampler_state: str | None = None,
    ) -> concurrent.futures.Future:
        """Like finish() but returns a future at once (the compute thread may move on)."""
        self.report.compute_end = self.clock()
        self._put((_DONE, (first_token, logprob, timeout, sampler_state)))
        return self._run_future

    def abort(self) -> None:
        """Stop: layers still queued are dropped, no END goes out. Wait for closed() before
        freeing the blocks a ViewPayload may still be reading."""
        self._aborted = True
        self._put((_DONE, None))
        self.loop.call_soon_threadsafe(self._fail_transfer)

    def _fail_transfer(self) -> None:
        """On the loop: end a wait for ACK at once (a layer being written finishes first)."""
        fail = getattr(self._transfer, "_fail", None)
        if fail is not None:
            fail(TransferError(f"transfer for {self.ticket.request_id!r} aborted by the caller"))

    def closed(self) -> concurrent.futures.Future:
        """Done once the sender holds no view of this request's blocks any more."""
        return self._run_future

    def _put(self, item) -> None:
        if not self._queue_ready.wait(timeout=30.0):
            raise TransferError("kv sender loop did not start within 30s")
        self.loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def _run(self) -> StreamReport:
        self._queue = asyncio.Queue()
        self._queue_ready.set()
        transfer = None
        try:
            transfer = self._transfer = await self.sender.open(self.ticket)
            if self._aborted:
                self._fail_transfer()
            while True:
                layer, item = await self._queue.get()
                if layer is _DONE or self._aborted:
                    item = None if self._aborted else item
                    break
                timing = self.report.layers[layer]
                timing.send_start = self.clock()
                await transfer.send_layer(layer, item)
                timing.send_end = self.clock()
            if item is None:
                raise TransferError(
                    f"transfer for {self.ticket.request_id!r} aborted by the caller"
                )
            first_token, logprob, timeout, sampler_state = item
            self.report.ack = await transfer.finish(first_token, logprob, timeout, sampler_state)
            self.report.ack_at = self.clock()
            self.report.resent_layers = list(getattr(transfer, "resent_layers", []))
            return self.report
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            if transfer is not None:
                await transfer.abort()
            buffers, self._buffers = self._buffers, []
            for buf in buffers:
                self._pool.release(buf)
