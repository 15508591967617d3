"""gather_layer / scatter_layer: token-major payloads, re-blocking and head splits."""

import pytest
import torch
from kv_helpers import random_caches

from baton.kv.layout import gather_layer, scatter_layer


def tokens_of(k, v, block_ids, block_size, num_tokens):
    """Reference: walk the block table token by token."""
    rows_k = [k[block_ids[t // block_size], t % block_size] for t in range(num_tokens)]
    rows_v = [v[block_ids[t // block_size], t % block_size] for t in range(num_tokens)]
    return torch.stack([torch.stack(rows_k), torch.stack(rows_v)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gather_matches_block_table_walk(dtype):
    ((k, v),) = random_caches(1, 10, 16, 4, 8, dtype)
    blocks = [7, 0, 3, 9]
    payload = gather_layer(k, v, blocks, 16, 50, 0, 4)
    assert payload.shape == (2, 50, 4, 8) and payload.dtype == dtype and payload.is_contiguous()
    assert torch.equal(payload, tokens_of(k, v, blocks, 16, 50))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reblock_16_to_32(dtype):
    ((k, v),) = random_caches(1, 12, 16, 4, 8, dtype, seed=1)
    src_blocks, num_tokens = [11, 4, 6, 1, 8], 70  # 5 blocks of 16
    dst_k = torch.zeros(6, 32, 4, 8, dtype=dtype)
    dst_v = torch.zeros_like(dst_k)
    dst_blocks = [5, 0, 2]  # 3 blocks of 32
    payload = gather_layer(k, v, src_blocks, 16, num_tokens, 0, 4)
    scatter_layer(payload, dst_k, dst_v, dst_blocks, 32, 0)
    assert torch.equal(
        tokens_of(dst_k, dst_v, dst_blocks, 32, num_tokens),
        tokens_of(k, v, src_blocks, 16, num_tokens),
    )
    # Blocks outside the table stay untouched.
    assert dst_k[[1, 3, 4]].abs().sum() == 0 and dst_v[[1, 3, 4]].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_split_across_two_receivers(dtype):
    heads = 8
    ((k, v),) = random_caches(1, 4, 16, heads, 8, dtype, seed=2)
    blocks, num_tokens = [2, 0, 3], 33
    shards = []
    for start, end in ((0, heads // 2), (heads // 2, heads)):
        payload = gather_layer(k, v, blocks, 16, num_tokens, start, end)
        assert payload.shape == (2, num_tokens, end - start, 8)
        # Each receiver holds only its heads, so it writes at offset 0 of its own cache.
        shard_k = torch.zeros(3, 32, end - start, 8, dtype=dtype)
        shard_v = torch.zeros_like(shard_k)
        scatter_layer(payload, shard_k, shard_v, [1, 2], 32, 0)
        shards.append(tokens_of(shard_k, shard_v, [1, 2], 32, num_tokens))
    assert torch.equal(torch.cat(shards, dim=2), tokens_of(k, v, blocks, 16, num_tokens))


def test_scatter_into_full_cache_at_head_offset():
    ((k, v),) = random_caches(1, 2, 16, 4, 8, torch.float32, seed=3)
    payload = gather_layer(k, v, [1, 0], 16, 20, 2, 4)
    dst_k, dst_v = torch.zeros(2, 16, 4, 8), torch.zeros(2, 16, 4, 8)
    scatter_layer(payload, dst_k, dst_v, [0, 1], 16, 2)
    assert dst_k[:, :, :2].abs().sum() == 0
    assert torch.equal(tokens_of(dst_k, dst_v, [0, 1], 16, 20)[:, :, 2:], payload)


def test_token_offset_round_trip():
    ((k, v),) = random_caches(1, 4, 16, 2, 4, torch.float32, seed=4)
    part = gather_layer(k, v, [3, 1, 2], 16, 20, 0, 2, token_start=10)
    assert torch.equal(part, tokens_of(k, v, [3, 1, 2], 16, 30)[:, 10:])
    dst_k, dst_v = torch.zeros(4, 16, 2, 4), torch.zeros(4, 16, 2, 4)
    scatter_layer(part, dst_k, dst_v, [0, 2], 16, 0, token_start=10)
    assert torch.equal(tokens_of(dst_k, dst_v, [0, 2], 16, 30)[:, 10:], part)


def test_refuses_bad_inputs():
    ((k, v),) = random_caches(1, 4, 16, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="block_ids"):
        gather_layer(k, v, [0], 16, 17, 0, 4)  # one block cannot hold 17 tokens
    with pytest.raises(ValueError, match="block_ids"):
        gather_layer(k, v, [9], 16, 4, 0, 4)  # no block 9
    with pytest.raises(ValueError, match="head range"):
        gather_layer(k, v, [0], 16, 4, 2, 5)
    with pytest.raises(ValueError, match="block size"):
        gather_layer(k, v, [0], 32, 4, 0, 4)
    payload = gather_layer(k, v, [0], 16, 4, 0, 4)
    with pytest.raises(ValueError, match="dtype"):
        scatter_layer(payload.half(), k, v, [1], 16, 0)
    with pytest.raises(ValueError, match="head_start"):
        scatter_layer(payload, k, v, [1], 16, 1)
    with pytest.raises(ValueError, match="contiguous"):
        scatter_layer(payload, k.transpose(0, 1), v.transpose(0, 1), [1], 4, 0)
