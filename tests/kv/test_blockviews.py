"""Block-run views: a layer's payload as byte ranges of the cache, no gather or scatter."""

import asyncio
import socket

import crc32c
import pytest
import torch
from kv_helpers import random_caches

from baton.kv.blockviews import (
    IOV_MAX,
    ViewPayload,
    block_runs,
    checksum_views,
    layer_views,
)
from baton.kv.conn import FrameConn
from baton.kv.layout import gather_layer
from baton.kv.wire import FrameKind, layer_header, tensor_bytes


def test_consecutive_blocks_coalesce_into_runs():
    assert list(block_runs([4, 5, 6, 9, 10, 2], 16, 96)) == [(64, 48), (144, 32), (32, 16)]


def test_the_last_block_is_cut_at_the_prompt_end():
    assert list(block_runs([4, 5, 6, 9], 16, 50)) == [(64, 48), (144, 2)]
    assert list(block_runs([3], 16, 1)) == [(48, 1)]


def test_blocks_past_the_prompt_are_left_out():
    # headroom blocks reserved for generation carry nothing
    assert list(block_runs([7, 8, 9, 10], 16, 20)) == [(112, 20)]


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="cannot hold"):
        block_runs([1, 2], 16, 33)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("blocks", [[0, 1, 2, 3], [7, 0, 3, 9], [2, 3, 8, 9]])
def test_views_hold_exactly_the_gathered_payload(dtype, blocks):
    ((k, v),) = random_caches(1, 10, 16, 4, 8, dtype, seed=3)
    views = layer_views(k, v, blocks, 16, 50, 0, 4)
    gathered = gather_layer(k, v, blocks, 16, 50, 0, 4)
    assert b"".join(views) == bytes(tensor_bytes(gathered))


def test_views_write_into_the_blocks_themselves():
    k = torch.zeros(6, 16, 2, 4)
    v = torch.zeros_like(k)
    views = layer_views(k, v, [4, 1], 16, 20, 0, 2)
    assert [view.nbytes for view in views] == [16 * 32, 4 * 32, 16 * 32, 4 * 32]
    for view in views:
        view[:] = b"\x01" * view.nbytes
    touched = (k != 0).flatten(1).any(dim=1).tolist()
    assert touched == [False, True, False, False, True, False]
    assert (k[1, 4:] == 0).all()  # past the prompt's last token: untouched


@pytest.mark.parametrize(
    "case",
    ["head_shard", "other_block_size", "strided"],
)
def test_layouts_that_need_a_copy_give_no_views(case):
    ((k, v),) = random_caches(1, 4, 16, 4, 8, torch.float32)
    if case == "head_shard":
        assert layer_views(k, v, [0, 1], 16, 20, 0, 2) is None
    elif case == "other_block_size":
        assert layer_views(k, v, [0, 1], 32, 20, 0, 4) is None
    else:
        k2, v2 = k.transpose(2, 3), v.transpose(2, 3)
        assert layer_views(k2, v2, [0, 1], 16, 20, 0, 8) is None


def test_out_of_range_block_ids_are_refused():
    ((k, v),) = random_caches(1, 4, 16, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="block_ids"):
        layer_views(k, v, [3, 4], 16, 20, 0, 4)


def test_incremental_checksum_equals_one_over_the_joined_bytes():
    parts = [b"kv-", b"", b"blocks" * 1000, bytes(range(256))]
    views = [memoryview(p) for p in parts]
    assert checksum_views(views) == crc32c.crc32c(b"".join(parts))


def test_a_view_payload_checksums_like_the_gathered_tensor():
    ((k, v),) = random_caches(1, 10, 16, 4, 8, torch.float32, seed=4)
    blocks = [5, 6, 1]
    payload = ViewPayload(tuple(layer_views(k, v, blocks, 16, 40, 0, 4)), (2, 40, 4, 8), torch.float32)
    by_views = layer_header("r", 0, blocks, payload)
    by_copy = layer_header("r", 0, blocks, gather_layer(k, v, blocks, 16, 40, 0, 4))
    assert by_views == by_copy and by_views.kind == FrameKind.LAYER


def test_a_view_payload_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="views hold"):
        ViewPayload((memoryview(bytes(12)),), (2, 1, 1, 2), torch.float32)


def test_many_views_cross_a_real_socket_in_order():
    """More pieces than one sendmsg/recvmsg_into call takes, both ways, on a real socket."""
    count = IOV_MAX * 2 + 7
    pieces = [bytes([i % 251]) * (1 + i % 5) for i in range(count)]
    sizes = [len(p) for p in pieces]

    async def main():
        a, b = socket.socketpair()
        sender, receiver = FrameConn(a), FrameConn(b)
        dest = bytearray(sum(sizes))
        mv = memoryview(dest)
        cuts, offset = [], 0
        for size in reversed(sizes):  # different boundaries on the receiving side
            cuts.append(mv[offset : offset + size])
            offset += size
        try:
            _, crc = await asyncio.gather(
                sender.send_buffers(pieces), receiver.recv_into_views(cuts, checksum=True)
            )
        finally:
            sender.close()
            receiver.close()
        return bytes(dest), crc

    data, crc = asyncio.run(main())
    assert data == b"".join(pieces)
    assert crc == crc32c.crc32c(data)  # taken piece by piece as the bytes landed


def test_views_of_a_layer_inside_one_big_pool_land_in_that_layer():
    """The model runner keeps every layer's K and V in one tensor [layers, 2, blocks, ...]."""
    pool = torch.zeros(3, 2, 5, 16, 2, 4)
    k, v = pool[1, 0], pool[1, 1]
    for view in layer_views(k, v, [2, 3], 16, 20, 0, 2):
        view[:] = b"\x01" * view.nbytes
    written = (pool != 0).flatten(3).any(dim=3)  # [layers, 2, blocks]
    assert written.nonzero().tolist() == [[1, 0, 2], [1, 0, 3], [1, 1, 2], [1, 1, 3]]


def test_checksum_follows_partial_fills_across_views():
    """recvmsg_into may stop anywhere, mid-view included: the running CRC must still equal
    one CRC over everything received."""
    from baton.kv.conn import _advance, _checksum_filled

    data = bytes(range(256)) * 4
    dest = bytearray(len(data))
    mv = memoryview(dest)
    views = [mv[0:100], mv[100:101], mv[101:700], mv[700:]]
    first, crc, pos = 0, 0, 0
    for step in (37, 63, 1, 250, 349, 324):  # chunk sizes as a socket might deliver them
        chunk = data[pos : pos + step]
        # what recvmsg_into does: fill the views in order
        left, i = memoryview(chunk), first
        while left.nbytes:
            take = min(left.nbytes, views[i].nbytes if i > first else views[first].nbytes)
            views[i][:take] = left[:take]
            left, i = left[take:], i + 1
        crc = _checksum_filled(views, first, step, crc)
        first = _advance(views, first, step)
        pos += step
    assert pos == len(data) and first == len(views)
    assert bytes(dest) == data and crc == crc32c.crc32c(data)
