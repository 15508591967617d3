"""Rotate-half (NeoX) rotary position embedding (twin of ref.rotary_embedding).

cos_sin_cache is [max_pos, D] fp32 with cos in the first D/2 columns and sin in the last.
One program per token rotates all its heads; q and k are done by two launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, pos_ptr, cos_sin_ptr,
    sx_n, sx_h, sx_d, so_n, so_h, so_d, scs,
    num_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    j_mask = j < half
    mask = (h < num_heads) & j_mask
    cos = tl.load(cos_sin_ptr + pos * scs + j, mask=j_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * scs + half + j, mask=j_mask, other=0.0).to(tl.float32)
    src = x_ptr + tok * sx_n + h * sx_h
    x1 = tl.load(src + j * sx_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + (half + j) * sx_d, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + tok * so_n + h * so_h
    ty = out_ptr.dtype.element_ty
    tl.store(dst + j * so_d, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + (half + j) * so_d, (x2 * cos + x1 * sin).to(ty), mask=mask)


def _rotate(positions, x, cos_sin_cache):
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    half = head_dim // 2
    assert cos_sin_cache.stride(1) == 1, "cos_sin_cache rows must be contiguous"
    _rope_kernel[(num_tokens,)](
        x, out, positions, cos_sin_cache,
        *x.stride(), *out.stride(), cos_sin_cache.stride(0),
        num_heads, half,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
    )
    return out


def rotary_embedding(
    positions: torch.Tensor,  # [N]
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos in [:D/2], sin in [D/2:], fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (NeoX) RoPE, as HF Llama applies it."""
    return _rotate(positions, q, cos_sin_cache), _rotate(positions, k, cos_sin_cache)
