"""Every Triton kernel against its torch reference in kernels/ref.py.

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest.py), which is very slow,
so shapes are tiny. With BATON_TRITON_DEVICE=cuda the same tests run compiled on the GPU,
plus larger, model-sized cases.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; Triton kernel tests skipped")

from baton.engine.kernels import get_ops, ref  # noqa: E402
from baton.engine.kernels import triton as tk  # noqa: E402

ON_GPU = os.environ.get("BATON_TRITON_DEVICE") == "cuda"
DTYPES = [torch.float32, torch.bfloat16]
# (Hq, Hkv, D): plain GQA and an odd group (as SmolLM2's 9/3 heads).
HEADS = [(4, 2, 16), (3, 1, 32)]
if ON_GPU:
    HEADS += [(9, 3, 64), (32, 8, 128)]


def _cache(num_blocks, block_size, hkv, d, dtype, device, gen):
    shape = (num_blocks, block_size, hkv, d)
    k = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    return k, v


def _tables(lengths, block_size, gen, device):
    """Block tables with shuffled, non-contiguous block ids (a few blocks stay unused);
    the width covers the longest sequence. Returns (tables, num_blocks)."""
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = width * len(lengths) + 3
    ids = torch.randperm(num_blocks, generator=gen)[: width * len(lengths)]
    return ids.reshape(len(lengths), width).to(dtype=torch.int32, device=device), num_blocks


def _slots(tables, block_size, cu, ctx):
    """Slot of every new token: position cached + i of its sequence."""
    slots = []
    for b in range(len(ctx)):
        q_len = cu[b + 1] - cu[b]
        for pos in range(ctx[b] - q_len, ctx[b]):
            slots.append(int(tables[b, pos // block_size]) * block_size + pos % block_size)
    return slots


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_skips_minus_one(dtype, kernel_device, check):
    gen = torch.Generator().manual_seed(1)
    n, hkv, d, bs = 7, 2, 16, 4
    # K/V as strided views of a fused projection, as the engine produces them.
    kv = torch.randn(n, 2 * hkv + 1, d, generator=gen).to(dtype=dtype, device=kernel_device)
    key, value = kv[:, :hkv], kv[:, hkv : 2 * hkv]
    slots = torch.tensor([5, -1, 0, 11, -1, 14, 3], device=kernel_device)
    k_ref, v_ref = _cache(4, bs, hkv, d, dtype, kernel_device, gen)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    ref.store_kvcache(key, value, k_ref, v_ref, slots)
    tk.store_kvcache(key, value, k_out, v_out, slots)
    check("store_kvcache", k_out, k_ref)
    check("store_kvcache", v_out, v_ref)
    assert torch.equal(k_out.view(-1, hkv, d)[5], key[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_paged_decode_attention(dtype, heads, kernel_device, check):
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(2)
    bs = 4
    # Lengths that end mid-block, on a block boundary, and a single token.
    lengths = [5, 12, 1, 8]
    if ON_GPU and d >= 64:
        bs, lengths = 16, [1, 17, 300, 1024, 77, 512, 2000, 64]
    tables, num_blocks = _tables(lengths, bs, gen, kernel_device)
    k_cache, v_cache = _cache(num_blocks, bs, hkv, d, dtype, kernel_device, gen)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=kernel_device)
    q = torch.randn(len(lengths), hq, d, generator=gen).to(dtype=dtype, device=kernel_device)
    scale = d**-0.5
    expected = ref.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    actual = tk.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    check("paged_decode_attention", actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_paged_prefill_attention(dtype, heads, kernel_device, check):
    """One batch mixing fresh prompts and extends (cached tokens), as chunked prefill does."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(3)
    bs = 8
    # (new tokens, cached tokens): fresh, extend mid-block, fresh over two q tiles,
    # extend of one token across a block boundary.
    seqs = [(3, 0), (4, 6), (18, 0), (1, 9)]
    if ON_GPU and d >= 64:
        bs, seqs = 16, [(100, 0), (37, 500), (300, 1), (1, 63), (200, 200)]
    q_lens = [n for n, _ in seqs]
    ctx = [n + c for n, c in seqs]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    tables, num_blocks = _tables(ctx, bs, gen, kernel_device)
    k_cache, v_cache = _cache(num_blocks, bs, hkv, d, dtype, kernel_device, gen)

    def rand(h):
        return torch.randn(cu[-1], h, d, generator=gen).to(dtype=dtype, device=kernel_device)

    q, k, v = rand(hq), rand(hkv), rand(hkv)
    slots = torch.tensor(_slots(tables, bs, cu, ctx), device=kernel_device)
    tk.store_kvcache(k, v, k_cache, v_cache, slots)
    scale = d**-0.5
    expected = ref.paged_prefill_attention(q, k, v, k_cache, v_cache, tables, cu, ctx, scale)
    actual = tk.paged_prefill_attention(q, k, v, k_cache, v_cache, tables, cu, ctx, scale)
    check("paged_prefill_attention", actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(dtype, kernel_device, check):
    gen = torch.Generator().manual_seed(4)
    hidden = 4096 if ON_GPU else 48  # not a power of two on CPU: exercises the mask

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=kernel_device)

    x, residual, weight = rand(2, 3, hidden), rand(2, 3, hidden), rand(hidden)
    x0, r0 = x.clone(), residual.clone()
    check("rms_norm", tk.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    out, res = tk.fused_add_rms_norm(x, residual, weight, 1e-5)
    out_ref, res_ref = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    check("fused_add_rms_norm", res, res_ref)
    check("fused_add_rms_norm", out, out_ref)
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs must be left untouched"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding(dtype, kernel_device, check):
    gen = torch.Generator().manual_seed(5)
    n, hq, hkv, d, max_pos = 6, 3, 1, 32, 64
    if ON_GPU:
        n, hq, hkv, d, max_pos = 512, 32, 8, 128, 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(kernel_device)
    positions = torch.randint(0, max_pos, (n,), generator=gen).to(kernel_device)
    # q and k as strided views of one fused QKV buffer.
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=gen).to(dtype=dtype, device=kernel_device)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    q_out, k_out = tk.rotary_embedding(positions, q, k, cos_sin)
    q_ref, k_ref = ref.rotary_embedding(positions, q, k, cos_sin)
    check("rotary_embedding", q_out, q_ref)
    check("rotary_embedding", k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, kernel_device, check):
    gen = torch.Generator().manual_seed(6)
    inner = 1536 if ON_GPU else 40
    x = (3 * torch.randn(2, 5, 2 * inner, generator=gen)).to(dtype=dtype, device=kernel_device)
    check("silu_and_mul", tk.silu_and_mul(x), ref.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_head_range_round_trip(dtype, kernel_device, check):
    gen = torch.Generator().manual_seed(7)
    bs, hkv, d = 4, 3, 16
    k_cache, v_cache = _cache(6, bs, hkv, d, dtype, kernel_device, gen)
    ids = torch.tensor([4, 0, 2], device=kernel_device)
    packed = tk.pack_kv_blocks(k_cache, v_cache, ids, 1, 3)
    check("pack_kv_blocks", packed, ref.pack_kv_blocks(k_cache, v_cache, ids, 1, 3))
    assert packed.is_contiguous() and packed.shape == (2, 3, bs, 2, d)

    # Into other blocks at another head offset, as a receiver with a different layout would.
    dst_ids = torch.tensor([1, 5, 3], device=kernel_device)
    k_dst, v_dst = _cache(6, bs, hkv, d, dtype, kernel_device, gen)
    k_ref, v_ref = k_dst.clone(), v_dst.clone()
    tk.unpack_kv_blocks(packed, k_dst, v_dst, dst_ids, 0)
    ref.unpack_kv_blocks(packed, k_ref, v_ref, dst_ids, 0)
    check("unpack_kv_blocks", k_dst, k_ref)
    check("unpack_kv_blocks", v_dst, v_ref)

    # Round trip: unpack(pack(x)) restores exactly the packed heads and nothing else.
    k_rt, v_rt = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    tk.unpack_kv_blocks(packed, k_rt, v_rt, ids, 1)
    idx = ids.long()
    assert torch.equal(k_rt[idx, :, 1:3], k_cache[idx, :, 1:3])
    assert torch.equal(v_rt[idx, :, 1:3], v_cache[idx, :, 1:3])
    assert not k_rt[:, :, 0].any() and not k_rt[[1, 3, 5]].any()


def test_get_ops_selects_backend(monkeypatch):
    monkeypatch.delenv("BATON_KERNELS", raising=False)
    ops = get_ops(torch.device("cpu"))
    assert ops.backend == "ref" and ops.paged_decode_attention is ref.paged_decode_attention
    monkeypatch.setenv("BATON_KERNELS", "triton")
    ops = get_ops(torch.device("cpu"))
    assert ops.backend == "triton" and ops.rms_norm is tk.rms_norm
    monkeypatch.setenv("BATON_KERNELS", "ref")
    assert get_ops("cuda").backend == "ref"
    monkeypatch.setenv("BATON_KERNELS", "bogus")
    with pytest.raises(ValueError, match="BATON_KERNELS"):
        get_ops("cpu")
    if ON_GPU:
        monkeypatch.delenv("BATON_KERNELS")
        assert get_ops("cuda").backend == "triton"
