"""Pack and unpack one layer's KV blocks for a head range (twins of ref.pack_kv_blocks and
ref.unpack_kv_blocks), so a transfer moves one contiguous buffer per layer.

Each program copies one chunk of one block's [block_size, h, D] slab; the flat index inside
the slab is split into (offset, head, dim) so any cache strides and head ranges work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, ids_ptr,
    ss_b, ss_o, ss_h, ss_d,  # source strides
    sd_b, sd_o, sd_h, sd_d,  # destination strides
    src_head0, dst_head0, heads, head_dim, slab,
    IDS_ON_SRC: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = e < slab
    off = e // (heads * head_dim)
    h = (e // head_dim) % heads
    d = e % head_dim
    blk = tl.load(ids_ptr + i).to(tl.int64)
    # Packing gathers cache blocks into rows 0..n-1; unpacking scatters them back.
    if IDS_ON_SRC:
        sb, db = blk, i.to(tl.int64)
    else:
        sb, db = i.to(tl.int64), blk
    x = tl.load(src_ptr + sb * ss_b + off * ss_o + (src_head0 + h) * ss_h + d * ss_d, mask=mask)
    dst = dst_ptr + db * sd_b + off * sd_o + (dst_head0 + h) * sd_h + d * sd_d
    tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


def _copy(src, dst, block_ids, src_head0, dst_head0, heads, ids_on_src):
    n = block_ids.numel()
    slab = src.shape[1] * heads * src.shape[3]
    if n == 0 or slab == 0:
        return
    block = min(1024, triton.next_power_of_2(slab))
    _copy_blocks_kernel[(n, triton.cdiv(slab, block))](
        src, dst, block_ids,
        *src.stride(), *dst.stride(),
        src_head0, dst_head0, heads, src.shape[3], slab,
        IDS_ON_SRC=ids_on_src, BLOCK=block,
    )


def pack_kv_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [n] int
    head_start: int,
    head_end: int,
) -> torch.Tensor:
    """One layer's K and V for some blocks and a head range, contiguous: [2, n, bs, h, D]."""
    _, block_size, _, head_dim = k_cache.shape
    heads = head_end - head_start
    ids = block_ids.to(device=k_cache.device)
    dtype = torch.promote_types(k_cache.dtype, v_cache.dtype)
    packed = torch.empty((2, ids.numel(), block_size, heads, head_dim), dtype=dtype,
                         device=k_cache.device)
    _copy(k_cache, packed[0], ids, head_start, 0, heads, True)
    _copy(v_cache, packed[1], ids, head_start, 0, heads, True)
    return packed


def unpack_kv_blocks(
    packed: torch.Tensor,  # [2, n, bs, h, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    head_start: int,
) -> None:
    """Inverse of pack_kv_blocks: write packed blocks into the cache at a head offset."""
    ids = block_ids.to(device=k_cache.device)
    heads = packed.shape[3]
    packed = packed.to(k_cache.device)
    _copy(packed[0], k_cache, ids, 0, head_start, heads, False)
    _copy(packed[1], v_cache, ids, 0, head_start, heads, False)
