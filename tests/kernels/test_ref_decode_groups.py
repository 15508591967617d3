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
