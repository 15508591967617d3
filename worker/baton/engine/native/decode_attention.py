"""The native decode step's attention (decode_step.c's `baton_decode_attention`) as the torch
path's `paged_decode_attention`: the decode rows of a step that also carries prompt tokens.

torch's form (kernels/ref.py) gathers each group of contexts out of the paged cache, widens a
bf16 cache to the activations' dtype and pads to the group's longest; the native loops read
each K/V row once where it lies. A decode row then also gets the values a decode-only step
gives it (the same loops), whatever shares its step."""

from __future__ import annotations

import ctypes

import torch


def supported(lib: ctypes.CDLL | None, dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """None where the native decode attention serves these dtypes, else why not."""
    if lib is None:
        return "native library unavailable"
    if kv_dtype not in (torch.float32, torch.bfloat16):
        return f"a {kv_dtype} KV cache"
    if dtype not in (torch.float32, torch.bfloat16) or (dtype == torch.bfloat16 and kv_dtype != torch.bfloat16):
        return f"{dtype} activations over a {kv_dtype} KV cache"
    return None


def paged_decode_attention_op(lib: ctypes.CDLL):
    """ref.paged_decode_attention's signature; results within float32 summation of it (bf16
    activations: rounded to bf16 as that path rounds its output)."""

    def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
        rows, num_heads, head_dim = q.shape
        queries = q
        if q.dtype != torch.float32 or q.stride()[1:] != (head_dim, 1):  # rows may lie apart (a QKV view)
            queries = q.to(torch.float32).contiguous()
        out = torch.empty((rows, num_heads, head_dim), dtype=torch.float32)
        # the dtypes the step's metadata holds them in: no copy there
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int64).contiguous()
        status = lib.baton_decode_attention(
            queries.data_ptr(), queries.stride(0), rows, k_cache.data_ptr(), v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16), k_cache.shape[0], tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), k_cache.shape[1], num_heads, k_cache.shape[2], head_dim, scale,
            int(q.dtype == torch.bfloat16), out.data_ptr())
        if status != 0:
            raise RuntimeError(f"native decode attention refused {rows} rows of {num_heads} heads "
                               f"(KV heads {k_cache.shape[2]}, head size {head_dim}, contexts {lens.tolist()}, "
                               f"a block table outside the cache's {k_cache.shape[0]} blocks, or too short)")
        return out.to(q.dtype)

    return paged_decode_attention
