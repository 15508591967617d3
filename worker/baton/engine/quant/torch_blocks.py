"""Dequantizing GGUF rows with torch ops, on any device: the full-precision reference of the
Triton kernel's tests, and a tile's weights on CPUs without the native library."""

from __future__ import annotations

import torch

from baton.engine.quant.formats import BLOCK, BlockFormat


def dequantize_rows(fmt: BlockFormat, raw: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, nb * block_bytes] -> float32 [rows, nb * 32], as formats.dequantize."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, fmt.block_bytes)
    d = _half(blocks[..., 0:2])
    quants = blocks[..., fmt.header_bytes:]
    if fmt.nibbles:
        u = torch.cat([quants & 0x0F, quants >> 4], dim=-1)
        if fmt.fifth_bits:  # bit j of the 4 bytes before the nibbles: value j's, worth 16
            words = blocks[..., fmt.scale_bytes : fmt.header_bytes].to(torch.int64)
            word = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
            bits = (word[..., None] >> torch.arange(BLOCK, device=raw.device)) & 1
            u = u | (bits << 4).to(torch.uint8)
        if fmt.lookup:
            u = torch.tensor(fmt.lookup, dtype=torch.uint8, device=raw.device)[u.long()]
    else:
        u = quants ^ 0x80
    if fmt.has_min:
        values = d[..., None] * u.float() + _half(blocks[..., 2:4])[..., None]
    else:
        values = d[..., None] * (u.to(torch.int32) - fmt.offset).float()
    return values.reshape(rows, -1 if rows else blocks.shape[1] * BLOCK)


def _half(pair: torch.Tensor) -> torch.Tensor:
    """Two little-endian bytes -> their float16 value as float32."""
    bits = pair[..., 0].to(torch.int32) | (pair[..., 1].to(torch.int32) << 8)
    return bits.to(torch.int16).view(torch.float16).float()
