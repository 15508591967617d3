"""Rotate-half RoPE for the torch path's steps in the native step's loop (decode_step.c's
`baton_rope_f32`): in place on float32 query and key heads that share rows (a fused QKV
projection's output), the same bits as ref.rotary_embedding. Other layouts and dtypes go to
the op it wraps."""

from __future__ import annotations

import ctypes

import torch

from baton.engine.kernels.ref import adjacent_heads


def rotary_embedding_op(lib: ctypes.CDLL, fallback):
    """ref.rotary_embedding's signature and results; q and k are rotated in place where the
    native loop takes them (they are returned as the same views)."""

    def rotary_embedding(positions, q, k, cos_sin_cache):
        if (q.dtype != torch.float32 or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous()
                or q.shape[0] == 0 or not adjacent_heads(q, k) or q.shape[2] != cos_sin_cache.shape[1]):
            return fallback(positions, q, k, cos_sin_cache)
        rows = q.shape[0]
        where = positions.to(torch.int64).contiguous()
        if where.numel() != rows:
            raise ValueError(f"RoPE: {where.numel()} positions for {rows} rows")
        if lib.baton_rope_f32(q.data_ptr(), rows, q.stride(0), q.shape[1] + k.shape[1], q.shape[2],
                              cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], where.data_ptr()) != 0:
            raise IndexError(f"RoPE: positions {int(where.min())}..{int(where.max())} outside the "
                             f"{cos_sin_cache.shape[0]} the cos/sin table holds")
        return q, k

    return rotary_embedding
