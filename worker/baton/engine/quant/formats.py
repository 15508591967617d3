"""GGUF block formats that Baton multiplies without dequantizing the matrix (pure numpy).

Every format cuts a row into blocks of 32 values and stores each block as a float16 scale
(and, for Q4_1 and Q5_1, a float16 minimum) followed by its quants (ggml's ggml-common.h):

    Q4_0  d, 16 bytes of nibbles                      value = d * (q - 8),   q in 0..15
    Q4_1  d, m, 16 bytes of nibbles                   value = d * q + m,     q in 0..15
    Q5_0  d, 4 bytes of fifth bits, 16 of nibbles     value = d * (q - 16),  q in 0..31
    Q5_1  d, m, 4 bytes of fifth bits, 16 of nibbles  value = d * q + m,     q in 0..31
    Q8_0  d, 32 signed bytes                          value = d * q,         q in -128..127
    IQ4_NL d, 16 bytes of nibbles                     value = d * K[q],      q in 0..15

A nibble byte i holds value i in its low half and value i + 16 in its high half; in the
5-bit formats bit i of the (little-endian) 32-bit word before them is value i's fifth bit,
worth 16. IQ4_NL's nibbles index K, 16 signed levels spaced for a bell-shaped distribution.
Every format is then `d * u + m` for an unsigned u, the form the kernels compute on: Q4_0
has m = -8 d, Q5_0 m = -16 d, Q8_0 stores u = q + 128 (the sign bit flipped) with m = -128
d, and IQ4_NL's u = K[q] + 128 (its `lookup`), with m = -128 d too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # values per block, in every format here
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


class UnsupportedQuantization(ValueError):
    """A tensor's quantization has no kernel here."""


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # ggml's type id (GGMLQuantizationType)
    block_bytes: int
    nibbles: bool  # 4-bit quants (two a byte) rather than 8-bit
    has_min: bool  # a stored float16 minimum (Q4_1, Q5_1)
    offset: int  # m = -offset * d where no minimum is stored
    fifth_bits: bool = False  # a 32-bit word of fifth bits before the nibbles (Q5_0, Q5_1)
    lookup: tuple[int, ...] | None = None  # u for each nibble, where the levels are not linear (IQ4_NL)

    @property
    def scale_bytes(self) -> int:
        return 4 if self.has_min else 2

    @property
    def header_bytes(self) -> int:
        """Bytes before a block's nibbles or bytes: scales, and fifth bits where there are."""
        return self.scale_bytes + (4 if self.fifth_bits else 0)


FORMATS = {f.name: f for f in (
    BlockFormat("Q4_0", 2, 18, nibbles=True, has_min=False, offset=8),
    BlockFormat("Q4_1", 3, 20, nibbles=True, has_min=True, offset=0),
    BlockFormat("Q5_0", 6, 22, nibbles=True, has_min=False, offset=16, fifth_bits=True),
    BlockFormat("Q5_1", 7, 24, nibbles=True, has_min=True, offset=0, fifth_bits=True),
    BlockFormat("Q8_0", 8, 34, nibbles=False, has_min=False, offset=128),
    BlockFormat("IQ4_NL", 20, 18, nibbles=True, has_min=False, offset=128, lookup=tuple(k + 128 for k in IQ4_NL_LEVELS)),
)}
BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}


def format_named(name: str, tensor: str = "", also: tuple[str, ...] = ()) -> BlockFormat:
    """The format called `name` (ggml's spelling), or a clear error naming it and the
    formats that are read (these and `also`, those a loader rewrites into these)."""
    fmt = FORMATS.get(name.upper())
    if fmt is None:
        where = f" (tensor {tensor})" if tensor else ""
        raise UnsupportedQuantization(
            f"quantization type {name}{where} has no quantized kernel here (supported: "
            f"{', '.join([*FORMATS, *also])}); load the checkpoint with --quantization none to run it "
            "at full precision")
    return fmt


def row_bytes(fmt: BlockFormat, k: int) -> int:
    if k % BLOCK:
        raise ValueError(f"a {fmt.name} row holds whole blocks of {BLOCK} values, not {k}")
    return k // BLOCK * fmt.block_bytes


def float16_values(pair: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian bytes -> float32 [...] of the float16 they hold."""
    return np.ascontiguousarray(pair).view(np.float16)[..., 0].astype(np.float32)


def split_blocks(fmt: BlockFormat, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw uint8 [rows, nb * block_bytes] -> (d float32 [rows, nb], m float32 [rows, nb],
    u uint8 [rows, nb, 32]): value j of block b is d[b] * u[b, j] + m[b]."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, fmt.block_bytes)
    d = float16_values(blocks[..., 0:2])
    if fmt.has_min:
        m = float16_values(blocks[..., 2:4])
    else:
        m = np.float32(-fmt.offset) * d
    quants = blocks[..., fmt.header_bytes:]
    if fmt.nibbles:
        u = np.concatenate([quants & 0x0F, quants >> 4], axis=-1)
        if fmt.fifth_bits:
            u |= fifth_bits(blocks[..., fmt.scale_bytes : fmt.header_bytes]) << 4
        if fmt.lookup:
            u = np.asarray(fmt.lookup, dtype=np.uint8)[u]
    else:
        u = quants ^ np.uint8(0x80)  # q + 128 as an unsigned byte
    return d, m, u


def fifth_bits(words: np.ndarray) -> np.ndarray:
    """[..., 4] bytes of a 5-bit block's fifth bits -> uint8 [..., 32]: value j's, 0 or 1."""
    return np.unpackbits(np.ascontiguousarray(words, dtype=np.uint8), axis=-1, bitorder="little")


def dequantize(fmt: BlockFormat, raw: np.ndarray) -> np.ndarray:
    """raw uint8 [rows, row_bytes] -> float32 [rows, k], rounded as ggml rounds: Q4_1 and
    Q5_1 as d * q + m (two float32 roundings), the others as d * (q - offset) (exact)."""
    d, m, u = split_blocks(fmt, raw)
    if fmt.has_min:
        values = d[..., None] * u.astype(np.float32) + m[..., None]
    else:
        values = d[..., None] * (u.astype(np.int32) - fmt.offset).astype(np.float32)
    return values.reshape(raw.shape[0], -1)
