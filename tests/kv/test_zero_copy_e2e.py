"""Zero-copy handoff over real sockets: the sender sends from its cache blocks, the receiver
reads into its reserved blocks (TCP); shared memory and head shards keep the copy path."""

import time
from contextlib import contextmanager

import pytest
import torch
from kv_helpers import DirectSink, make_ticket, random_caches, receiver_for, sender_for

from baton.kv.buffers import BufferPool
from baton.kv.layout import gather_layer
from baton.kv.stream import BackgroundLoop, LayerStreamer
from baton.kv.transport import TransferError

LAYERS, HEADS, HEAD_DIM = 5, 4, 8


class CountingPool(BufferPool):
    """Counts gather buffers taken: none when layers go out from the blocks."""

    def __init__(self):
        super().__init__()
        self.acquired = 0

    def acquire(self, shape, dtype):
        self.acquired += 1
        return super().acquire(shape, dtype)
SRC_BLOCKS = [6, 7, 1, 4, 5, 0]  # runs [6, 7], [1], [4, 5], [0]: views of several runs


@contextmanager
def connected(transport_name, sink, on_wire=None, receiver_close_s=5):
    """A started receiver around `sink` and a sender to it, on one background loop."""
    with BackgroundLoop() as bg:
        receiver = receiver_for(transport_name, sink)
        bg.run(receiver.start(), timeout=5)
        sender = sender_for(transport_name, receiver.endpoint, on_wire=on_wire)
        try:
            yield bg, sender
        finally:
            bg.run(sender.close(), timeout=5)
            bg.run(receiver.close(), timeout=receiver_close_s)


def stream(transport_name, sink, ticket, src, on_wire=None, pool=None):
    sink.issue(ticket)
    with connected(transport_name, sink, on_wire) as (bg, sender):
        streamer = LayerStreamer(ticket, sender, bg.loop, src_block_ids=SRC_BLOCKS,
                                 src_block_size=16, blocks_stable=True, buffers=pool or BufferPool())
        for layer, (k, v) in enumerate(src):
            streamer.on_layer_done(layer, k, v)
        report = streamer.finish(first_token=5, timeout=10)
        streamer.closed().result(5)
    return report, streamer


def arrived_intact(src, sink, ticket, heads=(0, HEADS)):
    for layer, (k, v) in enumerate(src):
        sent = gather_layer(k, v, SRC_BLOCKS, 16, ticket.num_tokens, *heads)
        got = gather_layer(*sink.caches[layer], ticket.block_ids, ticket.block_size,
                           ticket.num_tokens, 0, heads[1] - heads[0])
        assert torch.equal(got, sent), f"layer {layer} differs"


@pytest.mark.parametrize("dst_block_size, dst_blocks", [(16, [2, 3, 9, 4, 5, 6, 1]), (32, [4, 0, 2])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layers_go_from_blocks_to_blocks(transport_name, dst_block_size, dst_blocks, dtype):
    src = random_caches(LAYERS, 8, 16, HEADS, HEAD_DIM, dtype, seed=31)
    sink = DirectSink(LAYERS, 10, dst_block_size, HEADS, HEAD_DIM, dtype)
    ticket = make_ticket(request_id="zc", block_ids=dst_blocks, block_size=dst_block_size,
                         dtype=str(dtype).removeprefix("torch."), num_layers=LAYERS, num_tokens=83)
    pool = CountingPool()
    report, _ = stream(transport_name, sink, ticket, src, pool=pool)
    assert report.ack.layers == LAYERS and sink.finished["zc"] == (5, None)
    arrived_intact(src, sink, ticket)
    assert pool.acquired == 0  # no gather buffer was taken: sent from the blocks
    direct = [(layer, ok) for _, layer, ok in sink.direct_writes]
    # TCP reads into the blocks; shared memory hands over a segment that the sink copies
    assert direct == ([(i, True) for i in range(LAYERS)] if transport_name == "tcp" else [])
    # headroom blocks and the tail of the last block stay untouched
    k, _ = sink.caches[0]
    used = -(-83 // dst_block_size)
    untouched = [b for b in range(10) if b not in dst_blocks[:used]]
    assert k[untouched].abs().sum() == 0
    assert k[dst_blocks[used - 1], 83 - (used - 1) * dst_block_size :].abs().sum() == 0


def test_a_corrupt_layer_read_into_the_blocks_is_resent_from_the_blocks():
    src = random_caches(LAYERS, 8, 16, HEADS, HEAD_DIM, torch.float32, seed=32)
    sink = DirectSink(LAYERS, 10, 16, HEADS, HEAD_DIM, torch.float32)
    ticket = make_ticket(request_id="zc-bad", block_ids=[8, 9, 0, 1, 2, 3], num_layers=LAYERS, num_tokens=90)
    hits = []

    def corrupt_layer_3_once(header, view):
        if header.layer == 3 and not hits:
            hits.append(3)
            bad = bytearray(view)
            bad[len(bad) - 5] ^= 0x40
            return bad
        return view

    report, _ = stream("tcp", sink, ticket, src, on_wire=corrupt_layer_3_once)
    assert report.resent_layers == [3]
    assert [(layer, ok) for _, layer, ok in sink.direct_writes if layer == 3] == [(3, False), (3, True)]
    assert sink.writes.count(("zc-bad", 3)) == 1
    arrived_intact(src, sink, ticket)


def test_head_shards_read_straight_into_each_shard():
    """A receiver holding only its heads still takes the whole layer into its blocks."""
    src = random_caches(LAYERS, 8, 16, HEADS, HEAD_DIM, torch.float32, seed=33)
    sink = DirectSink(LAYERS, 4, 32, HEADS // 2, HEAD_DIM, torch.float32, head_base=2)
    ticket = make_ticket(request_id="zc-shard", block_ids=[1, 3], block_size=32, num_layers=LAYERS,
                         num_tokens=60, head_start=2, head_end=4)
    # the sender has all 4 heads and sends 2: it must gather (no views of a head range)
    pool = CountingPool()
    stream("tcp", sink, ticket, src, pool=pool)
    assert pool.acquired == LAYERS
    arrived_intact(src, sink, ticket, heads=(2, 4))
    assert [ok for *_, ok in sink.direct_writes] == [True] * LAYERS


class SlowFinishSink(DirectSink):
    """Its ACK comes only after a long pause: the sender sits waiting for it."""

    async def finish(self, ticket, first_token, logprob, stats, sampler_state=None):
        import asyncio

        await asyncio.sleep(4)
        super().finish(ticket, first_token, logprob, stats, sampler_state)


def test_abort_while_waiting_for_ack_closes_the_streamer_at_once():
    """The prefill worker frees its blocks once closed() is done: that must not wait for
    the ACK deadline, and no layer is read from the blocks after it."""
    src = random_caches(LAYERS, 8, 16, HEADS, HEAD_DIM, torch.float32, seed=34)
    sink = SlowFinishSink(LAYERS, 10, 16, HEADS, HEAD_DIM, torch.float32)
    ticket = make_ticket(request_id="zc-abort", block_ids=[0, 1, 2, 3, 4, 5], num_layers=LAYERS, num_tokens=90)
    sink.issue(ticket)
    with connected("tcp", sink, receiver_close_s=15) as (bg, sender):
        streamer = LayerStreamer(ticket, sender, bg.loop, src_block_ids=SRC_BLOCKS,
                                 src_block_size=16, blocks_stable=True)
        for layer, (k, v) in enumerate(src):
            streamer.on_layer_done(layer, k, v)
        done = streamer.finish_async(first_token=1, timeout=30)
        time.sleep(0.5)  # END is out; the ACK is 4 s away
        started = time.monotonic()
        streamer.abort()
        with pytest.raises(TransferError, match="aborted"):
            streamer.closed().result(5)
        assert time.monotonic() - started < 2 and done.done()
