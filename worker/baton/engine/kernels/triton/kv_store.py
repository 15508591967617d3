"""Write new tokens' K and V into the paged KV cache (twin of ref.store_kvcache)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    sk_n, sk_h, sk_d,  # key strides
    sv_n, sv_h, sv_d,  # value strides
    sc_b, sc_o, sc_h, sc_d,  # cache strides (K and V caches share a layout)
    block_size, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # slot -1 marks a token whose KV is already cached: mask everything out. (A limit,
    # not `& (slot >= 0)`: the interpreter rejects masks broadcast from a scalar.)
    mask = (heads < tl.where(slot >= 0, num_heads, 0)) & (dims < head_dim)
    safe = tl.maximum(slot, 0)
    dst = (safe // block_size) * sc_b + (safe % block_size) * sc_o + heads * sc_h + dims * sc_d
    k = tl.load(key_ptr + tok * sk_n + heads * sk_h + dims * sk_d, mask=mask)
    v = tl.load(value_ptr + tok * sv_n + heads * sv_h + dims * sv_d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int, -1 = skip (token already cached)
) -> None:
    """Write each token's K and V into its cache slot."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share a layout"
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(),
        k_cache.shape[1], num_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
