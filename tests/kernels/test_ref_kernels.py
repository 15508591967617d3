"""kernels/ref.py against naive dense computations (float64, written out by hand)."""

from __future__ import annotations

import math

import pytest
import torch

from baton.engine.kernels import compute_prompt_attention_in, get_ops, ref


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _dense_attention(q, k, v, scale, visible):
    """q [n, Hq, D], k/v [L, Hkv, D], visible [n, L] bool -> [n, Hq, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # query head i uses KV head i // group
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def _scatter(cache, table, start, rows):
    """Write rows for positions start.. of one sequence into a paged cache, by hand."""
    bs = cache.shape[1]
    for i, row in enumerate(rows):
        pos = start + i
        cache[int(table[pos // bs]), pos % bs] = row


def test_store_kvcache_matches_slot_arithmetic():
    g = _gen(0)
    key, value = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    slots = torch.tensor([9, -1, 0, 4, 11])
    ref.store_kvcache(key, value, k_cache, v_cache, slots)
    written = 0
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 4, slot % 4], key[t])
            assert torch.equal(v_cache[slot // 4, slot % 4], value[t])
            written += 1
    assert int((k_cache.abs().sum((-1, -2)) > 0).sum()) == written


@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 1)])
def test_decode_attention_is_dense_softmax(hq, hkv):
    g = _gen(1)
    d, bs, lengths = 16, 4, [5, 12, 1]
    k_cache, v_cache = torch.randn(12, bs, hkv, d, generator=g), torch.randn(12, bs, hkv, d, generator=g)
    tables = torch.randperm(12, generator=g)[:9].reshape(3, 3).int()
    q = torch.randn(3, hq, d, generator=g)
    out = ref.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lengths), 0.3)
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        k = torch.stack([k_cache[int(tables[b, p // bs]), p % bs] for p in pos])
        v = torch.stack([v_cache[int(tables[b, p // bs]), p % bs] for p in pos])
        want = _dense_attention(q[b : b + 1], k, v, 0.3, torch.ones(1, n, dtype=torch.bool))
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=1e-5, rtol=1e-5)


def test_prefill_with_cache_is_full_causal_attention():
    """Each sequence's new tokens == the last rows of causal attention on the whole sequence."""
    g = _gen(2)
    hq, hkv, d, bs = 4, 2, 16, 4
    seqs = [(5, 0), (3, 6), (1, 7)]  # (new, cached): fresh, extend mid-block, one token
    k_cache, v_cache = torch.zeros(16, bs, hkv, d), torch.zeros(16, bs, hkv, d)
    tables = torch.randperm(16, generator=g)[:9].reshape(3, 3).int()
    full = []
    for b, (n, c) in enumerate(seqs):
        qkv = [torch.randn(n + c, h, d, generator=g) for h in (hq, hkv, hkv)]
        _scatter(k_cache, tables[b], 0, qkv[1])
        _scatter(v_cache, tables[b], 0, qkv[2])
        full.append(qkv)
    new = [torch.cat([f[i][c:] for f, (_, c) in zip(full, seqs, strict=True)]) for i in range(3)]
    cu = [0, 5, 8, 9]
    ctx = [n + c for n, c in seqs]
    out = ref.paged_prefill_attention(*new, k_cache, v_cache, tables, cu, ctx, 0.25)
    for b, (n, c) in enumerate(seqs):
        q, k, v = full[b]
        causal = torch.ones(n + c, n + c, dtype=torch.bool).tril()
        want = _dense_attention(q, k, v, 0.25, causal)[c:]
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].double(), want, atol=1e-5, rtol=1e-5)


def test_prompt_attention_computed_in_bf16_returns_the_activations_dtype():
    """fp32 activations on a bf16 CPU: the prompt attention runs in bf16 and comes back fp32,
    close to the fp32 result; the cache is read as it is stored."""
    g = _gen(3)
    hq, hkv, d, bs = 4, 2, 16, 4
    k_cache, v_cache = torch.randn(16, bs, hkv, d, generator=g), torch.randn(16, bs, hkv, d, generator=g)
    tables = torch.arange(8).reshape(2, 4).int()
    q, k, v = (torch.randn(7, h, d, generator=g) for h in (hq, hkv, hkv))
    args = (k_cache, v_cache, tables, [0, 4, 7], [4, 9], 0.25)  # one fresh, one extending 6 cached
    ops = get_ops("cpu")
    want = ops.paged_prefill_attention(q, k, v, *args)
    compute_prompt_attention_in(ops, torch.bfloat16)
    got = ops.paged_prefill_attention(q, k, v, *args)
    assert got.dtype == torch.float32 and ops.prompt_attention_dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    assert not torch.equal(got, want)  # it did run in bf16
    assert ops.paged_prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), *args).dtype == torch.bfloat16
    assert get_ops("cpu").paged_prefill_attention is ref.paged_prefill_attention  # others untouched


def test_rope_is_complex_rotation():
    g = _gen(3)
    n, d, base = 5, 16, 10000.0
    half = d // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    angles = torch.arange(32, dtype=torch.float64)[:, None] * theta
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1).float()
    positions = torch.tensor([0, 3, 31, 7, 7])
    q, k = torch.randn(n, 3, d, generator=g), torch.randn(n, 1, d, generator=g)
    q_out, k_out = ref.rotary_embedding(positions, q, k, cos_sin)
    for x, got in ((q, q_out), (k, k_out)):
        # NeoX layout pairs element j with j + D/2: rotate x_j + i x_{j+D/2} by pos * theta_j.
        z = torch.complex(x[..., :half].double(), x[..., half:].double())
        z = z * torch.polar(torch.ones_like(angles[positions]), angles[positions])[:, None]
        want = torch.cat((z.real, z.imag), -1)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_rms_norm_and_fused_add_by_formula():
    g = _gen(4)
    x, r, w = torch.randn(3, 24, generator=g), torch.randn(3, 24, generator=g), torch.randn(24, generator=g)

    def norm(t):
        t = t.double()
        return w.double() * t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6)

    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6).double(), norm(x), atol=1e-5, rtol=1e-5)
    out, res = ref.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out.double(), norm(x + r), atol=1e-5, rtol=1e-5)
    assert ref.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6).dtype == torch.bfloat16


def test_silu_and_mul_by_formula():
    x = torch.randn(4, 2, 10, generator=_gen(5))
    gate, up = x[..., :5].double(), x[..., 5:].double()
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(ref.silu_and_mul(x).double(), want, atol=1e-6, rtol=1e-6)


def test_pack_unpack_round_trip():
    g = _gen(6)
    k_cache, v_cache = torch.randn(5, 4, 3, 8, generator=g), torch.randn(5, 4, 3, 8, generator=g)
    ids = torch.tensor([3, 0])
    packed = ref.pack_kv_blocks(k_cache, v_cache, ids, 1, 3)
    assert packed.shape == (2, 2, 4, 2, 8) and packed.is_contiguous()
    assert torch.equal(packed[0, 0], k_cache[3, :, 1:3]) and torch.equal(packed[1, 1], v_cache[0, :, 1:3])
    k_new, v_new = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ref.unpack_kv_blocks(packed, k_new, v_new, ids, 1)
    assert torch.equal(k_new[[3, 0], :, 1:3], k_cache[[3, 0], :, 1:3])
    assert torch.equal(v_new[[3, 0], :, 1:3], v_cache[[3, 0], :, 1:3])
    assert not k_new[:, :, 0].any() and not v_new[[1, 2, 4]].any()
    assert math.isclose(float(k_new.abs().sum()), float(k_cache[[3, 0], :, 1:3].abs().sum()), rel_tol=1e-6)
