"""The native decode attention (decode_step.c's `baton_decode_attention`), which the torch
path's decode rows use in steps that also carry prompt tokens: ref.paged_decode_attention's
values within float32 summation over float32 and bf16 caches, grouped heads, head sizes with
and without the vectorized loops, contexts across block edges; bf16 activations rounded as
that path rounds them; each row independent of its batch; clear refusals."""

from __future__ import annotations

import pytest
import torch

from baton.engine.kernels import ref
from baton.engine.native import decode_attention as native


def _paged(lens: list[int], hkv: int, d: int, kv_dtype: torch.dtype, block_size: int = 16, seed: int = 0):
    """A cache holding each row's context in shuffled blocks: (k_cache, v_cache, tables)."""
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    total = sum(per_row) + 3  # spare blocks no row owns
    k_cache = torch.randn(total, block_size, hkv, d, generator=gen).to(kv_dtype)
    v_cache = torch.randn(total, block_size, hkv, d, generator=gen).to(kv_dtype)
    order = torch.randperm(total, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), max(per_row), dtype=torch.int32)
    used = 0
    for r, blocks in enumerate(per_row):
        tables[r, :blocks] = order[used:used + blocks]
        used += blocks
    return k_cache, v_cache, tables


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens, hq, hkv, d", [
    ([1], 2, 1, 16),  # a single token of context
    ([300, 17, 64, 129], 9, 3, 64),  # SmolLM2's heads, contexts across block edges
    ([40, 2000], 8, 8, 128),  # no grouping, the widest vectorized head, one long context
    ([33, 5], 8, 4, 32),  # a head size the portable loops take
    ([20], 32, 1, 64),  # more query heads on one KV head than one pass takes
    ([70, 5], 8, 4, 64),  # groups of 2 and 4 heads, each V row widened once for the group
    ([37, 3], 4, 1, 64),
    ([50, 131], 4, 2, 128),
])
def test_it_matches_the_torch_path(lib, kv_dtype, lens, hq, hkv, d):
    k_cache, v_cache, tables = _paged(lens, hkv, d, kv_dtype)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(1))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d ** -0.5
    got = native.paged_decode_attention_op(lib)(q, k_cache, v_cache, tables, context_lens, scale)
    want = ref.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, context_lens, scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_bf16_activations_are_rounded_as_the_torch_path_rounds_them(lib):
    lens = [300, 45, 1]
    k_cache, v_cache, tables = _paged(lens, 3, 64, torch.bfloat16)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    context_lens = torch.tensor(lens, dtype=torch.int32)
    got = native.paged_decode_attention_op(lib)(q, k_cache, v_cache, tables, context_lens, 0.125)
    want = ref.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, context_lens, 0.125)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, got.float().bfloat16())
    torch.testing.assert_close(got.double(), want, atol=1.6e-2, rtol=1.6e-2)  # one bf16 rounding of the result


def test_a_row_does_not_depend_on_its_batch(lib):
    lens = [300, 17, 64]
    k_cache, v_cache, tables = _paged(lens, 3, 64, torch.bfloat16)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(3))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    attend = native.paged_decode_attention_op(lib)
    together = attend(q, k_cache, v_cache, tables, context_lens, 0.125)
    for r in range(len(lens)):
        alone = attend(q[r:r + 1], k_cache, v_cache, tables[r:r + 1], context_lens[r:r + 1], 0.125)
        assert torch.equal(alone[0], together[r])


def test_queries_read_in_place_from_a_fused_projection(lib):
    """q as the model hands it over, a view of the QKV output's rows: the same bits as a copy."""
    lens = [300, 17]
    k_cache, v_cache, tables = _paged(lens, 3, 64, torch.bfloat16)
    heads = torch.randn(len(lens), 9 + 2 * 3, 64, generator=torch.Generator().manual_seed(4))
    q = heads[:, :9]
    context_lens = torch.tensor(lens)
    attend = native.paged_decode_attention_op(lib)
    assert not q.is_contiguous()
    assert torch.equal(attend(q, k_cache, v_cache, tables, context_lens, 0.125),
                       attend(q.contiguous(), k_cache, v_cache, tables, context_lens, 0.125))


def test_a_context_longer_than_its_block_table_is_refused_by_name(lib):
    k_cache, v_cache, tables = _paged([20], 1, 16, torch.float32)
    q = torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="native decode attention refused 1 rows of 2 heads"):
        native.paged_decode_attention_op(lib)(q, k_cache, v_cache, tables, torch.tensor([33], dtype=torch.int32), 0.25)


def test_a_block_outside_the_cache_is_refused_not_read(lib):
    k_cache, v_cache, tables = _paged([20], 1, 16, torch.float32)
    q = torch.randn(1, 2, 16)
    tables[0, 1] = k_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache's 5 blocks"):
        native.paged_decode_attention_op(lib)(q, k_cache, v_cache, tables, torch.tensor([20], dtype=torch.int32), 0.25)


@pytest.mark.parametrize("dtype, kv_dtype, wanted", [
    (torch.float32, torch.float32, None),
    (torch.float32, torch.bfloat16, None),
    (torch.bfloat16, torch.bfloat16, None),
    (torch.bfloat16, torch.float32, "torch.bfloat16 activations over a torch.float32 KV cache"),
    (torch.float32, torch.float16, "a torch.float16 KV cache"),
])
def test_supported_names_what_it_does_not_take(lib, dtype, kv_dtype, wanted):
    assert native.supported(lib, dtype, kv_dtype) == wanted
    assert native.supported(None, dtype, kv_dtype) == "native library unavailable"
