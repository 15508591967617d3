"""Shared helpers for the KV handoff tests: tickets, a sink writing into real caches."""

from __future__ import annotations

import asyncio
import time
import uuid

import torch

from baton.kv.blockviews import layer_views
from baton.kv.layout import scatter_layer
from baton.kv.ticket import Ticket
from baton.kv.transport import KVSink, LayerWrite, select_transport

TOKEN = "test-token-1234"


def make_ticket(**overrides) -> Ticket:
    fields = dict(
        request_id="req-1",
        worker_id="decode-0",
        kv_endpoint="tcp://127.0.0.1:8101",
        block_ids=[5, 2, 7],
        block_size=16,
        dtype="float32",
        num_layers=4,
        num_kv_heads=4,
        head_dim=8,
        head_start=0,
        head_end=4,
        num_tokens=40,
        expires_at=time.time() + 60,
    )
    fields.update(overrides)
    return Ticket(**fields)


def random_caches(num_layers, num_blocks, block_size, heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype),
            torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype),
        )
        for _ in range(num_layers)
    ]


class CacheSink(KVSink):
    """A decode worker's memory in miniature: caches per layer, tickets it issued."""

    def __init__(self, num_layers, num_blocks, block_size, heads, head_dim, dtype, head_base=0):
        self.caches = [
            (
                torch.zeros(num_blocks, block_size, heads, head_dim, dtype=dtype),
                torch.zeros(num_blocks, block_size, heads, head_dim, dtype=dtype),
            )
            for _ in range(num_layers)
        ]
        self.head_base = head_base  # first model head this cache holds (tensor-parallel shard)
        self.tickets: dict[str, Ticket] = {}
        self.writes: list[tuple[str, int]] = []
        self.finished: dict[str, tuple[int, float | None]] = {}
        self.sampler_states: dict[str, str | None] = {}
        self.aborted: dict[str, str] = {}
        self.finish_event = asyncio.Event()

    def issue(self, ticket: Ticket) -> Ticket:
        self.tickets[ticket.request_id] = ticket
        return ticket

    def lookup(self, request_id):
        return self.tickets.get(request_id)

    def write_layer(self, ticket, layer, payload):
        k, v = self.caches[layer]
        scatter_layer(
            payload, k, v, ticket.block_ids, ticket.block_size, ticket.head_start - self.head_base
        )
        self.writes.append((ticket.request_id, layer))

    def finish(self, ticket, first_token, logprob, stats, sampler_state=None):
        self.tickets.pop(ticket.request_id, None)
        self.finished[ticket.request_id] = (first_token, logprob)
        self.sampler_states[ticket.request_id] = sampler_state
        self.stats = stats
        self.finish_event.set()

    def abort(self, ticket, reason):
        self.aborted[ticket.request_id] = reason

    def untouched(self) -> bool:
        return not self.writes and all(
            k.abs().sum() == 0 and v.abs().sum() == 0 for k, v in self.caches
        )


def run(coro, timeout: float = 20.0):
    """Run a test coroutine with a hard deadline, so a hang fails instead of stalling."""

    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def receiver_for(name: str, sink: CacheSink, worker_id: str = "decode-0", **options):
    transport = select_transport(name)
    address = "127.0.0.1:0" if name == "tcp" else f"t{uuid.uuid4().hex[:12]}"
    return transport.receiver(sink, worker_id=worker_id, address=address, token=TOKEN, **options)


def sender_for(
    name: str, endpoint: str, worker_id: str = "decode-0", token: str = TOKEN, **options
):
    return select_transport(name).sender(endpoint, worker_id=worker_id, token=token, **options)


class _ViewWrite(LayerWrite):
    def __init__(self, sink, request_id, layer, views):
        self.views, self._sink, self._key = views, sink, (request_id, layer)

    def end(self, ok):
        self._sink.direct_writes.append((*self._key, ok))
        if ok:
            self._sink.writes.append(self._key)


class DirectSink(CacheSink):
    """A CacheSink that lets the receiver read layers straight into its blocks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.direct_writes: list[tuple[str, int, bool]] = []

    def begin_layer_write(self, ticket, layer):
        k, v = self.caches[layer]
        start = ticket.head_start - self.head_base
        views = layer_views(k, v, ticket.block_ids, ticket.block_size, ticket.num_tokens,
                            start, start + ticket.num_heads)
        return None if views is None else _ViewWrite(self, ticket.request_id, layer, views)
