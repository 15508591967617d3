"""Decode attention splits batches of very different context lengths into groups; the
result must equal attending one sequence at a time."""

from __future__ import annotations

import torch

from baton.engine.kernels import ref


def test_mixed_lengths_equal_one_at_a_time():
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(200, 4, 2, 16), torch.randn(200, 4, 2, 16)
    lens = torch.tensor([5, 300, 7, 290, 40])
    tables = torch.stack([torch.randperm(200)[:100] for _ in range(5)]).int()
    q = torch.randn(5, 4, 16)
    assert ref._similar_length_groups(lens.tolist()) == [[0, 2, 4], [3, 1]]
    batched = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    for i in range(5):
        alone = ref.paged_decode_attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], 0.25)
        torch.testing.assert_close(batched[i : i + 1], alone)


def test_consecutive_blocks_are_read_in_place_with_the_same_result():
    """Blocks 10, 11, 12, ... are a slice of the cache (no gather); the answer must be the
    one the gather gives for the same data at scattered blocks."""
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(64, 4, 2, 16), torch.randn(64, 4, 2, 16)
    run = torch.arange(10, 20).int()
    scattered = torch.tensor([50, 3, 41, 7, 22, 60, 31, 0, 25, 48]).int()
    k_cache[scattered.long()], v_cache[scattered.long()] = k_cache[run.long()], v_cache[run.long()]
    q, lens = torch.randn(2, 4, 16), torch.tensor([37, 39])
    tables = torch.stack([run, run]).int()  # two rows of one run: the group's ids repeat
    plan = ref._decode_plan(torch.stack([run]).int(), lens[:1], 4)
    assert plan[0].first_block == 10 and ref._decode_plan(tables, lens, 4)[0].first_block is None
    in_place = ref.paged_decode_attention(q[:1], k_cache, v_cache, run[None], lens[:1], 0.25)
    gathered = ref.paged_decode_attention(q[:1], k_cache, v_cache, scattered[None], lens[:1], 0.25)
    assert torch.equal(in_place, gathered)
