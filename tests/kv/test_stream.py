"""LayerStreamer: layers leave while later layers compute; END/ACK; timings recorded."""

import time

import pytest
import torch
from kv_helpers import CacheSink, make_ticket, random_caches, receiver_for, sender_for

from baton.kv.layout import gather_layer
from baton.kv.stream import BackgroundLoop, LayerStreamer
from baton.kv.transport import TransferError

LAYERS = 6


def fake_prefill(streamer, caches, layer_seconds=0.01):
    """Stand-in for the model: 'compute' a layer, then report it."""
    for layer, (k, v) in enumerate(caches):
        time.sleep(layer_seconds)
        streamer.on_layer_done(layer, k, v)


def test_streamed_prefill_lands_in_decode_blocks(transport_name):
    src = random_caches(LAYERS, 10, 16, 4, 8, torch.bfloat16, seed=21)
    src_blocks = [9, 2, 5, 0]
    sink = CacheSink(LAYERS, 4, 32, 4, 8, torch.bfloat16)
    ticket = make_ticket(
        request_id="req-s",
        block_ids=[3, 1],
        block_size=32,
        dtype="bfloat16",
        num_layers=LAYERS,
        num_tokens=60,
    )
    sink.issue(ticket)
    with BackgroundLoop() as bg:
        receiver = receiver_for(transport_name, sink)
        bg.run(receiver.start(), timeout=5)
        sender = sender_for(transport_name, receiver.endpoint)
        try:
            streamer = LayerStreamer(
                ticket, sender, bg.loop, src_block_ids=src_blocks, src_block_size=16
            )
            fake_prefill(streamer, src)
            report = streamer.finish(first_token=99, logprob=-1.5, timeout=10)
        finally:
            bg.run(sender.close(), timeout=5)
            bg.run(receiver.close(), timeout=5)

    assert sink.finished["req-s"] == (99, -1.5)
    for layer, (k, v) in enumerate(src):
        sent = gather_layer(k, v, src_blocks, 16, 60, 0, 4)
        assert torch.equal(gather_layer(*sink.caches[layer], [3, 1], 32, 60, 0, 4), sent)

    assert report.ack.layers == LAYERS and report.total_bytes == ticket.total_payload_nbytes
    assert sorted(report.layers) == list(range(LAYERS))
    for timing in report.layers.values():
        assert timing.compute_end <= timing.gathered <= timing.send_start <= timing.send_end
    assert report.compute_end <= report.ack_at
    assert 0 <= report.exposed_seconds <= report.transfer_seconds
    assert 0 <= report.overlapped_layers <= LAYERS


def test_refused_stream_fails_at_finish_and_compute_goes_on(transport_name):
    src = random_caches(3, 4, 16, 4, 8, torch.float32)
    sink = CacheSink(3, 4, 16, 4, 8, torch.float32)
    ticket = make_ticket(request_id="nobody-reserved-this", num_layers=3, block_ids=[0, 1, 2])
    with BackgroundLoop() as bg:
        receiver = receiver_for(transport_name, sink)
        bg.run(receiver.start(), timeout=5)
        sender = sender_for(transport_name, receiver.endpoint)
        try:
            streamer = LayerStreamer(
                ticket, sender, bg.loop, src_block_ids=[0, 1, 2], src_block_size=16
            )
            fake_prefill(streamer, src, layer_seconds=0.05)  # must not raise mid-prefill
            with pytest.raises(TransferError, match="no reservation"):
                streamer.finish(first_token=1, timeout=5)
            assert streamer.failed is not None
        finally:
            bg.run(sender.close(), timeout=5)
            bg.run(receiver.close(), timeout=5)
    assert sink.untouched()
