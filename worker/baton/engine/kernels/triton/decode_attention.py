"""Paged decode attention with GQA (twin of ref.paged_decode_attention).

One program per (sequence, KV head) computes all the query heads that share that KV head,
so each K/V tile is read once per group. Tiles are tokens, not blocks: every token looks up
its own block, so any block size works. Scores use multiply + sum rather than tl.dot, since
a group is often far below tl.dot's 16-row minimum. Online softmax, fp32 throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    sq_b, sq_h, sq_d,
    so_b, so_h, so_d,
    sc_b, sc_o, sc_h, sc_d,
    sbt_b, sbt_n,
    block_size, group, head_dim, qk_scale,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g  # query heads i with i // group == kv_head
    gd_mask = (g < group)[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + seq * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d,
                mask=gd_mask, other=0.0).to(tl.float32)
    q = q * qk_scale  # scale and log2(e) folded in, so exp2 gives exp

    # Finite start for the running max: a fully masked tile then yields p = 0, not NaN.
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * sbt_b
    for start in range(0, ctx_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < ctx_len
        blk = tl.load(table + (n // block_size) * sbt_n, mask=n_mask, other=0).to(tl.int64)
        row = blk * sc_b + (n % block_size) * sc_o + kv_head * sc_h
        nd_mask = n_mask[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :] * sc_d,
                    mask=nd_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :] * sc_d,
                    mask=nd_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # empty context: write zeros
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * so_b + heads[:, None] * so_h + d[None, :] * so_d,
             out.to(out_ptr.dtype.element_ty), mask=gd_mask)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] tokens in the cache, the new one included
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole paged context (GQA)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share a layout"
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_g = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(head_dim)
    # The [G, N, D] product lives in registers: about 32 values a thread keeps it from
    # spilling on the GPU (checked with ptxas for sm_90).
    block_n = max(16, min(64, 4096 // (block_g * block_d)))
    block_n = 1 << (block_n.bit_length() - 1)  # round down to a power of two
    num_warps = 4 if block_g * block_n * block_d <= 8192 else 8
    context_lens = context_lens.to(device=q.device)
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out,
        *q.stride(), *out.stride(), *k_cache.stride(), *block_tables.stride(),
        k_cache.shape[1], group, head_dim, scale * LOG2E,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
    )
    return out
