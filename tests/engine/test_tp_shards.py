"""Which rank owns which heads, columns and vocabulary rows (pure), and weight slicing."""

from __future__ import annotations

import pytest
import torch

from baton.engine.parallel.shards import (
    Span,
    balanced_span,
    check_tensor_parallel,
    kv_head_owners,
    plan_shards,
)
from baton.engine.parallel.weight_shards import shard_tensor


@pytest.mark.parametrize("total,parts", [(10, 3), (49152, 3), (192, 4), (7, 7), (5, 2)])
def test_balanced_spans_tile_the_range(total, parts):
    spans = [balanced_span(total, parts, i) for i in range(parts)]
    assert spans[0].start == 0 and spans[-1].end == total
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    assert max(s.size for s in spans) - min(s.size for s in spans) <= 1


def _valid(hq, hkv, size):
    try:
        check_tensor_parallel(hq, hkv, size)
        return True
    except ValueError:
        return False


def test_every_accepted_split_gives_each_rank_the_kv_heads_its_queries_read():
    accepted = 0
    for hkv in range(1, 9):
        for group in range(1, 5):
            hq = hkv * group
            for size in range(1, 17):
                if not _valid(hq, hkv, size):
                    continue
                accepted += 1
                shards = plan_shards(hq, hkv, 96, 100, size)
                q_spans = [s.q_heads for s in shards]
                assert q_spans[0].start == 0 and q_spans[-1].end == hq
                assert all(a.end == b.start for a, b in zip(q_spans, q_spans[1:]))
                for s in shards:
                    kv_read = {h // group for h in range(s.q_heads.start, s.q_heads.end)}
                    assert kv_read == set(range(s.kv_heads.start, s.kv_heads.end)), (hq, hkv, size, s)
                owners = kv_head_owners(hkv, size)
                assert all(owners) and len({len(o) for o in owners}) == 1  # each head, equally often
    assert accepted > 50


@pytest.mark.parametrize("hq,hkv,size,named", [
    (9, 3, 2, ("2", "9 query heads")),  # SmolLM2 at TP=2
    (8, 4, 3, ("3", "8 query heads")),
    (12, 4, 6, ("6", "4 KV heads")),
    (8, 4, 0, ("0",)),
])
def test_a_split_the_heads_do_not_allow_names_both_numbers(hq, hkv, size, named):
    with pytest.raises(ValueError) as info:
        check_tensor_parallel(hq, hkv, size)
    for text in named:
        assert text in str(info.value)


def test_kv_heads_are_replicated_when_ranks_outnumber_them():
    shards = plan_shards(9, 3, 1536, 49152, 9)
    assert [s.kv_heads for s in shards] == [Span(h, h + 1) for h in (0, 0, 0, 1, 1, 1, 2, 2, 2)]
    assert kv_head_owners(3, 9) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert kv_head_owners(4, 2) == [[0], [0], [1], [1]]


def test_sliced_projections_recombine_to_the_full_products():
    """Column-parallel slices concatenate to the full output; row-parallel partial products
    sum to it (what the all-reduce does)."""
    torch.manual_seed(0)
    hidden, head_dim, hq, hkv, inter, vocab = 24, 4, 6, 2, 20, 31  # uneven columns and rows
    x = torch.randn(5, hidden, dtype=torch.float64)
    q_w = torch.randn(hq * head_dim, hidden, dtype=torch.float64)
    o_w = torch.randn(hidden, hq * head_dim, dtype=torch.float64)
    down_w = torch.randn(hidden, inter, dtype=torch.float64)
    head_w = torch.randn(vocab, hidden, dtype=torch.float64)
    for size in (1, 2, 6):
        shards = plan_shards(hq, hkv, inter, vocab, size)
        q = torch.cat([x @ shard_tensor("model.layers.0.self_attn.q_proj.weight", q_w, head_dim, s).T
                       for s in shards], dim=1)
        torch.testing.assert_close(q, x @ q_w.T)
        attn = torch.randn(5, hq * head_dim, dtype=torch.float64)
        o = sum(attn[:, s.q_heads.start * head_dim : s.q_heads.end * head_dim]
                @ shard_tensor("model.layers.0.self_attn.o_proj.weight", o_w, head_dim, s).T for s in shards)
        torch.testing.assert_close(o, attn @ o_w.T)
        act = torch.randn(5, inter, dtype=torch.float64)
        down = sum(act[:, s.intermediate.start : s.intermediate.end]
                   @ shard_tensor("model.layers.1.mlp.down_proj.weight", down_w, head_dim, s).T for s in shards)
        torch.testing.assert_close(down, act @ down_w.T)
        logits = torch.cat([x @ shard_tensor("lm_head.weight", head_w, head_dim, s).T for s in shards], dim=1)
        torch.testing.assert_close(logits, x @ head_w.T)
    norm = torch.randn(hidden)
    assert shard_tensor("model.layers.0.input_layernorm.weight", norm, head_dim, shards[1]) is norm


@pytest.mark.parametrize("fmt_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"])
def test_quantized_matrices_are_cut_into_whole_blocks_without_dequantizing(fmt_name):
    """Rows and block-aligned column runs stay quantized, holding exactly the values of the
    same cut of the dequantized matrix; a column cut inside a block is dequantized."""
    from baton.engine.quant.formats import FORMATS, dequantize
    from baton.engine.quant.weight import QuantizedTensor
    from tests.engine.quant_data import random_rows

    def values(t):
        return torch.from_numpy(dequantize(fmt, t.raw))

    fmt, head_dim = FORMATS[fmt_name], 32
    full = QuantizedTensor(fmt, random_rows(fmt, 192, 192), 192)  # 6 heads of 32, 192 columns
    for shard in plan_shards(6, 3, 192, 192, 3):
        rows = shard.q_heads.scaled(head_dim)
        q = shard_tensor("model.layers.0.self_attn.q_proj.weight", full, head_dim, shard)
        assert isinstance(q, QuantizedTensor) and q.shape == (rows.size, 192)
        assert torch.equal(values(q), values(full)[rows.start : rows.end])
        o = shard_tensor("model.layers.0.self_attn.o_proj.weight", full, head_dim, shard)
        assert isinstance(o, QuantizedTensor) and o.shape == (192, rows.size)
        assert torch.equal(values(o), values(full)[:, rows.start : rows.end])
        cols = shard.intermediate
        down = shard_tensor("model.layers.0.mlp.down_proj.weight", full, head_dim, shard)
        assert isinstance(down, QuantizedTensor)
        assert torch.equal(values(down), values(full)[:, cols.start : cols.end])
        head = shard_tensor("lm_head.weight", full, head_dim, shard)
        assert isinstance(head, QuantizedTensor)
        assert torch.equal(values(head), values(full)[shard.vocab.start : shard.vocab.end])
    narrow = QuantizedTensor(fmt, random_rows(fmt, 32, 160), 160)  # 160 columns in three: 54, 53, 53
    second = plan_shards(6, 3, 160, 192, 3)[1]
    assert second.intermediate.start % 32  # a cut inside a block
    down = shard_tensor("model.layers.0.mlp.down_proj.weight", narrow, head_dim, second)
    assert isinstance(down, torch.Tensor)
    assert torch.equal(down, values(narrow)[:, second.intermediate.start : second.intermediate.end])


def test_a_workers_cores_are_shared_out_to_its_ranks():
    from baton.engine.parallel.launcher import rank_cores

    assert [rank_cores([0, 1, 2, 3, 4], 2, r) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [rank_cores([6, 7], 4, r) for r in range(4)] == [[6], [7], [6], [7]]  # fewer cores: shared
    assert rank_cores([], 3, 1) == []  # no --cpu-core: no pinning
