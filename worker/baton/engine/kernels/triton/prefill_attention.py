"""Prefill / extend attention over the paged KV cache (twin of ref.paged_prefill_attention).

The new tokens' K/V must already be in the cache (the engine stores before attending), so
every key is read from the cache and one code path serves fresh prompts and extends alike.
The work is cut into tiles of BLOCK_M new tokens of one sequence; one program per
(tile, query head). Token i of a sequence with c cached tokens sits at position c + i.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, tiles_ptr, out_ptr,
    sq_n, sq_h, sq_d,
    so_n, so_h, so_d,
    sc_b, sc_o, sc_h, sc_d,
    sbt_b, sbt_n,
    block_size, group, head_dim, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    # tiles row: sequence, first new token of the tile, offset of the sequence in q,
    # new tokens of the sequence, context length (cached + new).
    meta = tiles_ptr + tile * 5
    seq = tl.load(meta).to(tl.int64)
    first = tl.load(meta + 1)
    q_base = tl.load(meta + 2)
    q_len = tl.load(meta + 3)
    ctx_len = tl.load(meta + 4)
    cached = ctx_len - q_len

    rows = first + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < q_len
    d_mask = d < head_dim
    tok = (q_base + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * sq_n + head * sq_h + d[None, :] * sq_d,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = cached + rows

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * sbt_b
    # The tile's last row sees keys up to cached + first + BLOCK_M - 1.
    kv_end = tl.minimum(ctx_len, cached + first + BLOCK_M)
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        blk = tl.load(table + (n // block_size) * sbt_n, mask=n_mask, other=0).to(tl.int64)
        row = blk * sc_b + (n % block_size) * sc_o + kv_head * sc_h
        nd_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :] * sc_d, mask=nd_mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :] * sc_d, mask=nd_mask, other=0.0)
        if DOT_FP32:
            # fp32 inputs (and the interpreter, which gets bf16 dots wrong): exact fp32.
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * so_n + head * so_h + d[None, :] * so_d,
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# The engine calls this once per layer with the same batch: keep the last tile table.
_tiles_cache: dict = {}


def _tile_table(cu_seqlens_q, context_lens, block_m: int, device) -> torch.Tensor:
    cu = [int(x) for x in cu_seqlens_q]
    ctx = [int(x) for x in context_lens]
    key = (tuple(cu), tuple(ctx), block_m, str(device))
    hit = _tiles_cache.get(key)
    if hit is not None:
        return hit
    rows = []
    for b, ctx_len in enumerate(ctx):
        q_len = cu[b + 1] - cu[b]
        if q_len > ctx_len:
            raise ValueError(f"sequence {b}: {q_len} new tokens but context length {ctx_len}")
        for first in range(0, q_len, block_m):
            rows.append((b, first, cu[b], q_len, ctx_len))
    tiles = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5).to(device)
    _tiles_cache.clear()
    _tiles_cache[key] = tiles
    return tiles


def paged_prefill_attention(
    q: torch.Tensor,  # [N, Hq, D], the new tokens of all sequences, concatenated
    k: torch.Tensor,  # [N, Hkv, D], their keys (already stored in the cache too)
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    cu_seqlens_q: list[int],  # B + 1 offsets into N
    context_lens: list[int],  # [B] cached + new tokens per sequence
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over cached + new context (extend / chunked prefill).

    k and v are unused: the keys are read from the cache, where they were stored already.
    """
    del k, v
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share a layout"
    out = torch.empty_like(q)
    on_gpu = q.device.type == "cuda"
    dot_fp32 = q.dtype == torch.float32 or not on_gpu
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs dims >= 16
    # Tile sizes chosen with ptxas -v for sm_90: bf16 tiles do not spill; exact fp32 dots
    # need far more registers, so smaller tiles (a few hundred bytes spill). The interpreter
    # prefers few, small tiles.
    if not on_gpu:
        block_m, block_n, num_warps = 16, 32, 4
    elif dot_fp32:
        block_m, block_n, num_warps = 32, 32, 4
    else:
        block_m, block_n, num_warps = 64, 64, 8 if block_d >= 128 else 4
    tiles = _tile_table(cu_seqlens_q, context_lens, block_m, q.device)
    if tiles.shape[0] == 0:
        return out
    _paged_prefill_kernel[(tiles.shape[0], num_heads)](
        q, k_cache, v_cache, block_tables, tiles, out,
        *q.stride(), *out.stride(), *k_cache.stride(), *block_tables.stride(),
        k_cache.shape[1], num_heads // num_kv_heads, head_dim, scale * LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_FP32=dot_fp32, num_warps=num_warps,
    )
    return out
