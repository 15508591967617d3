"""The native RoPE (decode_step.c's `baton_rope_f32`) the torch path uses on CPU: the same
bits as ref.rotary_embedding on a fused QKV projection's float32 rows, in place; every other
layout and dtype handed to the op it wraps; a positions count that does not fit refused."""

from __future__ import annotations

import pytest
import torch

from baton.engine.kernels import ref
from baton.engine.models.rope import cos_sin_cache
from baton.engine.native.rope import rotary_embedding_op


def _fused(rows: int, hq: int, hkv: int, d: int, dtype=torch.float32, seed: int = 0):
    """q, k and v as views of one [rows, hq + 2 hkv, d] projection output."""
    heads = torch.randn(rows, hq + 2 * hkv, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return heads, heads[:, :hq], heads[:, hq:hq + hkv], heads[:, hq + hkv:]


@pytest.mark.parametrize("rows, hq, hkv, d", [(1, 9, 3, 64), (256, 9, 3, 64), (7, 8, 4, 128), (3, 2, 1, 16)])
def test_it_gives_the_torch_path_bits_in_place(lib, rows, hq, hkv, d):
    cache = cos_sin_cache(d, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(1))
    heads, q, k, v = _fused(rows, hq, hkv, d)
    want_q, want_k = ref.rotary_embedding(positions, q.clone(), k.clone(), cache)
    v_before = v.clone()
    got_q, got_k = rotary_embedding_op(lib, ref.rotary_embedding)(positions, q, k, cache)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(v, v_before)  # the values are not heads it rotates


def test_other_layouts_and_dtypes_go_to_the_op_it_wraps(lib):
    cache = cos_sin_cache(64, 512, 10000.0, None)
    positions = torch.arange(5)
    calls = []

    def fallback(*args):
        calls.append(args[1].dtype)
        return ref.rotary_embedding(*args)

    rope = rotary_embedding_op(lib, fallback)
    _, q, k, _ = _fused(5, 9, 3, 64, torch.bfloat16)
    want = ref.rotary_embedding(positions, q, k, cache)
    got = rope(positions, q, k, cache)
    assert calls == [torch.bfloat16] and all(torch.equal(a, b) for a, b in zip(got, want))
    q, k = torch.randn(5, 9, 64), torch.randn(5, 3, 64)  # separate tensors: not one row's heads
    got = rope(positions, q, k, cache)
    assert len(calls) == 2 and all(torch.equal(a, b) for a, b in zip(got, ref.rotary_embedding(positions, q, k, cache)))


def test_a_position_count_that_does_not_fit_is_refused(lib):
    cache = cos_sin_cache(64, 512, 10000.0, None)
    _, q, k, _ = _fused(4, 9, 3, 64)
    with pytest.raises(ValueError, match="RoPE: 3 positions for 4 rows"):
        rotary_embedding_op(lib, ref.rotary_embedding)(torch.arange(3), q, k, cache)


def test_a_position_past_the_table_is_refused(lib):
    cache = cos_sin_cache(64, 512, 10000.0, None)
    _, q, k, _ = _fused(2, 9, 3, 64)
    with pytest.raises(IndexError, match="positions 3..512 outside the 512 the cos/sin table holds"):
        rotary_embedding_op(lib, ref.rotary_embedding)(torch.tensor([3, 512]), q, k, cache)
