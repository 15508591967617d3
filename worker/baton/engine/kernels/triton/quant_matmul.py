"""x @ W^T on a GGUF checkpoint's quantized rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), dequantizing each block
inside the matmul: the GPU side of quant/weight.py, on the blocks as the file stores them, or
as the loader rewrote them (quant/formats.py, quant/transcode.py). No full-precision copy of
W exists at any time."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.engine.quant.formats import BLOCK


@triton.jit
def _half(ptr, mask):
    """The float16 at two little-endian bytes, as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fifth_word(ptr, mask):
    """A 5-bit block's 32 fifth bits (bit j: value j's) as one int32 a row."""
    word = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    for i in tl.static_range(1, 4):
        word = word | (tl.load(ptr + i, mask=mask, other=0).to(tl.int32) << (8 * i))
    return word


@triton.jit
def _weights(d, m, u, HAS_MIN: tl.constexpr, OFFSET: tl.constexpr):
    """Dequantized as ggml does: d * u + m (Q4_1), else d * (u - offset) (exact)."""
    if HAS_MIN:
        return d * u + m
    return d * (u - OFFSET)


@triton.jit
def _accumulate(acc, x_rows, cols, mask_m, w, DOT_FP32: tl.constexpr):
    x = tl.load(x_rows + cols[None, :], mask=mask_m[:, None], other=0.0)
    if DOT_FP32:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, out_ptr, lookup_ptr, M, N, K, sxm, som,
                         BLOCK_BYTES: tl.constexpr, HEADER: tl.constexpr, NIBBLES: tl.constexpr,
                         FIFTH: tl.constexpr, LOOKUP: tl.constexpr, HAS_MIN: tl.constexpr,
                         OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_FP32: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < M, rn < N
    rows = w_ptr + rn.to(tl.int64) * ((K // 32) * BLOCK_BYTES)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(0, K // 32):
        block = rows + b * BLOCK_BYTES
        d = _half(block, mask_n)[:, None]
        m = d
        if HAS_MIN:
            m = _half(block + 2, mask_n)[:, None]
        if NIBBLES:  # byte j: value j in its low half, value j + 16 in its high half
            cols = tl.arange(0, 16)
            q = tl.load(block[:, None] + HEADER + cols[None, :], mask=mask_n[:, None], other=0).to(tl.int32)
            low, high = q & 15, q >> 4
            if FIFTH:  # the word before the nibbles: bit j is value j's fifth bit, worth 16
                word = _fifth_word(block + HEADER - 4, mask_n)[:, None]
                low = low | (((word >> cols[None, :]) & 1) << 4)
                high = high | (((word >> (cols[None, :] + 16)) & 1) << 4)
            if LOOKUP:  # IQ4_NL: the u each nibble stands for (formats.py), from a 16-entry table
                low = tl.load(lookup_ptr + low)
                high = tl.load(lookup_ptr + high)
            w_low = _weights(d, m, low.to(tl.float32), HAS_MIN, OFFSET)
            acc = _accumulate(acc, x_rows, b * 32 + cols, mask_m, w_low, DOT_FP32)
            w_high = _weights(d, m, high.to(tl.float32), HAS_MIN, OFFSET)
            acc = _accumulate(acc, x_rows, b * 32 + 16 + cols, mask_m, w_high, DOT_FP32)
        else:  # signed bytes: u = q + 128 with OFFSET 128 is d * q
            cols = tl.arange(0, 32)
            q = tl.load(block[:, None] + HEADER + cols[None, :], mask=mask_n[:, None], other=0)
            u = q.to(tl.int8, bitcast=True).to(tl.float32) + 128.0
            acc = _accumulate(acc, x_rows, b * 32 + cols, mask_m, _weights(d, m, u, HAS_MIN, OFFSET), DOT_FP32)
    out = out_ptr + rm.to(tl.int64)[:, None] * som + rn[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


def quant_matmul(x: torch.Tensor, weight) -> torch.Tensor:
    """float32 x [M, K] @ W^T for a quant.weight.QuantizedWeight in the GGUF layout, on x's
    device; the products accumulate in float32 (bf16/fp16 inputs meet bf16/fp16 weights)."""
    if weight.layout != "gguf":
        raise ValueError("the Triton kernel reads GGUF rows; this matrix was rearranged for the CPU")
    if weight.k % BLOCK:
        raise ValueError(f"a quantized row holds whole blocks of {BLOCK} values, not {weight.k}")
    x2 = x.reshape(-1, weight.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m_rows = x2.shape[0]
    out = torch.empty(m_rows, weight.shape[0], dtype=torch.float32, device=x.device)
    dot_fp32 = x.dtype == torch.float32 or x.device.type != "cuda"  # the interpreter: fp32 dots
    block_m = 16 if m_rows <= 16 else 32
    lookups = {}  # per format with a lookup: its table on x's device
    start = 0
    for fmt, rows, data in zip(weight.formats, weight.part_rows, weight.parts):
        view = out[:, start : start + rows]
        if m_rows and rows:
            grid = (triton.cdiv(m_rows, block_m), triton.cdiv(rows, 64))
            if fmt.lookup and fmt.name not in lookups:
                lookups[fmt.name] = torch.tensor(fmt.lookup, dtype=torch.int32, device=x.device)
            _quant_matmul_kernel[grid](
                x2, data, view, lookups.get(fmt.name, data), m_rows, rows, weight.k, x2.stride(0), out.stride(0),
                BLOCK_BYTES=fmt.block_bytes, HEADER=fmt.header_bytes, NIBBLES=fmt.nibbles,
                FIFTH=fmt.fifth_bits, LOOKUP=fmt.lookup is not None, HAS_MIN=fmt.has_min,
                OFFSET=float(fmt.offset), BLOCK_M=block_m, BLOCK_N=64, DOT_FP32=dot_fp32)
        start += rows
    return out.reshape(*x.shape[:-1], weight.shape[0])
