"""The CPU layout of a quantized matrix: 16 rows side by side, block by block (pure numpy).

The native kernels (native/quant_*.h) compute 16 output rows at once, one per 32-bit SIMD
lane, so they want each block's 16 scales in one load and its quants as 4-byte columns of
16 rows. A group of 16 rows, block b, is stored as

    d[16] (float16) | m[16] (float16, with a minimum) | fifth[16] (4 bytes, 5-bit formats) |
    quants: chunk c = bytes 4c..4c+3 of each row's block (4 chunks of nibbles, or 8 chunks of
    8-bit quants with the sign bit flipped)

groups one after another, each group's blocks in order. A 5-bit block's fifth bits are
reordered to follow its nibbles: byte b of a row's word holds, in bit j, the fifth bit of
the value in byte b of chunk j's low nibbles (value 4j + b), and in bit 4 + j that of its
high nibbles (16 + 4j + b), so one shift and one mask put a chunk's fifth bits beside its
nibbles (native/quant_kernels.h). It holds the same bits as the GGUF rows (a Q8_0 quant's
sign bit flipped), no more bytes; a last partial group is padded with zero rows, whose
outputs are dropped.
"""

from __future__ import annotations

import numpy as np

from baton.engine.quant.formats import BLOCK, BlockFormat, fifth_bits

ROWS = 16  # rows of one group: one per 32-bit lane of a 512-bit register


def group_count(rows: int) -> int:
    return -(-rows // ROWS)


def interleave(fmt: BlockFormat, raw: np.ndarray) -> np.ndarray:
    """GGUF rows uint8 [rows, nb * block_bytes] -> the CPU layout, flat uint8."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, fmt.block_bytes)
    nb = blocks.shape[1]
    padded = np.zeros((group_count(rows) * ROWS, nb, fmt.block_bytes), dtype=np.uint8)
    padded[:rows] = blocks
    groups = padded.reshape(-1, ROWS, nb, fmt.block_bytes).transpose(0, 2, 1, 3)  # [G, nb, 16, bytes]
    header = fmt.header_bytes
    scales = [groups[..., 0:2].reshape(*groups.shape[:2], 2 * ROWS)]
    if fmt.has_min:
        scales.append(groups[..., 2:4].reshape(*groups.shape[:2], 2 * ROWS))
    if fmt.fifth_bits:
        words = chunk_ordered_fifths(groups[..., fmt.scale_bytes : header])
        scales.append(words.reshape(*groups.shape[:2], 4 * ROWS))
    quants = groups[..., header:]
    if not fmt.nibbles:
        quants = quants ^ np.uint8(0x80)
    chunks = quants.reshape(*groups.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)  # [G, nb, chunk, 16, 4]
    out = np.concatenate([*scales, chunks.reshape(*groups.shape[:2], -1)], axis=-1)
    return np.ascontiguousarray(out).reshape(-1)


def deinterleave(fmt: BlockFormat, data: np.ndarray, rows: int, k: int) -> np.ndarray:
    """The inverse of `interleave`: the GGUF rows back."""
    nb = k // BLOCK
    groups = np.asarray(data, dtype=np.uint8).reshape(group_count(rows), nb, ROWS * fmt.block_bytes)
    header = fmt.header_bytes
    parts = [groups[..., : 2 * ROWS].reshape(*groups.shape[:2], ROWS, 2)]
    if fmt.has_min:
        parts.append(groups[..., 2 * ROWS : 4 * ROWS].reshape(*groups.shape[:2], ROWS, 2))
    if fmt.fifth_bits:
        at = fmt.scale_bytes * ROWS
        parts.append(value_ordered_fifths(groups[..., at : at + 4 * ROWS].reshape(*groups.shape[:2], ROWS, 4)))
    quants = groups[..., header * ROWS :].reshape(*groups.shape[:2], -1, ROWS, 4).transpose(0, 1, 3, 2, 4)
    quants = quants.reshape(*groups.shape[:2], ROWS, -1)
    if not fmt.nibbles:
        quants = quants ^ np.uint8(0x80)
    blocks = np.concatenate([*parts, quants], axis=-1).transpose(0, 2, 1, 3)  # [G, 16, nb, bytes]
    return np.ascontiguousarray(blocks.reshape(-1, nb * fmt.block_bytes)[:rows])


def chunk_ordered_fifths(words: np.ndarray) -> np.ndarray:
    """[..., 4] fifth-bit words as a file holds them (bit i: value i) -> the CPU layout's
    order (byte b, bit j: value 4j + b; bit 4 + j: value 16 + 4j + b)."""
    bits = fifth_bits(words)  # [..., 32] in value order
    low = bits[..., :16].reshape(*bits.shape[:-1], 4, 4).swapaxes(-1, -2)  # [..., byte, chunk]
    high = bits[..., 16:].reshape(*bits.shape[:-1], 4, 4).swapaxes(-1, -2)
    return np.packbits(np.concatenate([low, high], axis=-1), axis=-1, bitorder="little")[..., 0]


def value_ordered_fifths(words: np.ndarray) -> np.ndarray:
    """The inverse of `chunk_ordered_fifths`."""
    bits = np.unpackbits(np.ascontiguousarray(words)[..., None], axis=-1, bitorder="little")  # [..., byte, 8]
    low = bits[..., :4].swapaxes(-1, -2).reshape(*bits.shape[:-2], 16)
    high = bits[..., 4:].swapaxes(-1, -2).reshape(*bits.shape[:-2], 16)
    return np.packbits(np.concatenate([low, high], axis=-1), axis=-1, bitorder="little")
