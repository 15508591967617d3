"""SwiGLU (silu(gate) * up) for the torch path's float32 rows in native code (decode_step.c's
`baton_silu_and_mul_f32`): one pass over the fused gate/up projection's output, where torch
makes a temporary for silu and a second pass for the product. Other dtypes and layouts go to
the op it wraps."""

from __future__ import annotations

import ctypes

import torch


def silu_and_mul_op(lib: ctypes.CDLL, fallback):
    """ref.silu_and_mul's signature; within an ulp or two of its values (the exp differs)."""

    def silu_and_mul(x):
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % 2:
            return fallback(x)
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.float32)
        lib.baton_silu_and_mul_f32(x.data_ptr(), x.shape[0], x.shape[1] // 2, out.data_ptr())
        return out

    return silu_and_mul
