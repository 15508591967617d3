"""BufferPool: outgoing layers reuse touched buffers; a streamer gives them back after ACK."""

import torch
from kv_helpers import CacheSink, make_ticket, random_caches, receiver_for, sender_for

from baton.kv.buffers import BufferPool
from baton.kv.stream import BackgroundLoop, LayerStreamer


def test_released_buffer_is_handed_out_again():
    pool = BufferPool()
    a = pool.acquire((2, 3, 4, 8), torch.float32)
    assert a.shape == (2, 3, 4, 8) and a.dtype == torch.float32 and a.is_contiguous()
    ptr = a.data_ptr()
    pool.release(a)
    assert pool.idle_bytes == a.numel() * 4
    b = pool.acquire((2, 3, 4, 8), torch.float32)
    assert b.data_ptr() == ptr and pool.idle_bytes == 0
    c = pool.acquire((2, 3, 4, 8), torch.float32)  # none idle: a new one
    assert c.data_ptr() != ptr
    # same byte size, another dtype and shape: the storage is shared by size
    pool.release(b)
    d = pool.acquire((2, 3, 4, 16), torch.bfloat16)
    assert d.data_ptr() == ptr and d.dtype == torch.bfloat16


def test_idle_bytes_stay_under_the_cap():
    pool = BufferPool(max_idle_bytes=1000)
    bufs = [pool.acquire((100,), torch.float32) for _ in range(3)]  # 400 bytes each
    for buf in bufs:
        pool.release(buf)
    assert pool.idle_bytes == 800
    pool.release(pool.acquire((250,), torch.uint8))  # evicts the oldest size first
    assert pool.idle_bytes <= 1000
    pool.release(torch.empty(2000, dtype=torch.uint8))  # larger than the cap: dropped
    assert pool.idle_bytes <= 1000


def test_streamer_returns_its_buffers_and_the_next_transfer_reuses_them(transport_name):
    layers, pool = 3, BufferPool()
    src = random_caches(layers, 6, 16, 4, 8, torch.float32, seed=5)
    sink = CacheSink(layers, 6, 16, 4, 8, torch.float32)
    with BackgroundLoop() as bg:
        receiver = receiver_for(transport_name, sink)
        bg.run(receiver.start(), timeout=5)
        sender = sender_for(transport_name, receiver.endpoint)
        try:
            seen = []
            for i in range(2):
                ticket = sink.issue(make_ticket(request_id=f"req-b{i}", block_ids=[1, 4, 2],
                                                num_layers=layers, num_tokens=40))
                streamer = LayerStreamer(ticket, sender, bg.loop, src_block_ids=[0, 3, 5],
                                         src_block_size=16, buffers=pool)
                for layer, (k, v) in enumerate(src):
                    streamer.on_layer_done(layer, k, v)
                streamer.finish(first_token=7, timeout=10)
                seen.append(sorted(b.data_ptr() for b in pool._free[ticket.layer_payload_nbytes]))
                assert pool.idle_bytes == layers * ticket.layer_payload_nbytes
        finally:
            bg.run(sender.close(), timeout=5)
            bg.run(receiver.close(), timeout=5)
    assert seen[0] == seen[1]
    assert set(sink.finished) == {"req-b0", "req-b1"}
