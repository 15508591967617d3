"""GGUF formats without kernels of their own, rewritten at load into formats that have them.

Most GGUF files in circulation are k-quant mixes (Q4_K_M, Q5_K_M, Q6_K) or IQ4_XS; where a
matrix's width is not a multiple of 256 llama.cpp falls back to Q5_0, Q5_1, Q8_0 or IQ4_NL
for it, which are read as they are. Each other matrix becomes blocks of 32 the kernels read
(quant/formats.py), one tensor at a time, with no full-precision copy of more than a slice
of rows. Three keep their quants:

    Q4_K  -> Q4_1  the same 4-bit quants; a block's scale d * sc and minimum -dmin * m
                   (6-bit multipliers of the super-block's two float16 scales) rounded to
                   float16: each moves by at most 2^-11 of itself
    Q5_K  -> Q5_1  the same 5-bit quants, scales as Q4_K's
    IQ4_XS -> IQ4_NL  the same 4-bit indices into the same 16 levels; a block's scale
                   d * (ls - 32) (a 6-bit multiplier of the super-block's float16 d)
                   rounded to float16, as Q4_K's

and every other block format the `gguf` package reads (Q6_K, Q2_K, Q3_K, the IQ1-IQ3
families, TQ1_0, TQ2_0, MXFP4...) is requantized to Q8_0: 32 values a block to absmax / 127
steps, finer than the steps of any of them (Q6_K's are about four times coarser; Q2_K, Q3_K
and Q6_K scale sub-blocks of 16 values, which no format here holds). The cost is memory:
8.5 bits a value, against 6.6 for Q6_K, 3.4 for Q3_K and 2.6 for Q2_K.

The values of each source format are the `gguf` package's (ggml's definitions). A matrix
is rewritten in slices of rows on the process's cores (numpy leaves the interpreter lock
in its array loops), each slice to its place in the output.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial

import numpy as np

from baton.engine.quant.formats import BLOCK, FORMATS, BlockFormat, float16_values

SUPER = 256  # values per k-quant super-block
_Q4_K_BYTES = 144  # d, dmin (float16), 12 bytes of packed 6-bit scales and mins, 128 of nibbles
_Q5_K_BYTES = 176  # as Q4_K, with 32 bytes of fifth bits before the nibbles
_IQ4_XS_BYTES = 136  # d (float16), 2 bytes of scales' high bits, 4 of their low nibbles, 128 of nibbles
SLICE_VALUES = 1 << 22  # values rewritten at a time (per thread): bounds the temporaries


def transcoded_format(name: str) -> BlockFormat | None:
    """The kernel format a GGUF type `name` is rewritten into, or None if it is not (read
    as it is, or not a block format this machine's gguf package reads)."""
    target = _rewrite(name.upper())
    return FORMATS[target[0]] if target else None


def requantized(name: str) -> bool:
    """Whether `name` becomes Q8_0 by requantization (its quants are not kept)."""
    return name.upper() not in _EXACT and _rewrite(name.upper()) is not None


def rewritten_formats() -> tuple[str, ...]:
    """Every GGUF type a loader rewrites, those that keep their quants first."""
    from gguf import GGMLQuantizationType

    return (*_EXACT, *(t.name for t in GGMLQuantizationType if t.name not in _EXACT and _rewrite(t.name)))


def transcode(name: str, raw: np.ndarray, k: int, threads: int | None = None) -> tuple[BlockFormat, np.ndarray]:
    """uint8 [rows, row bytes] of GGUF type `name` -> (format, its uint8 [rows, k / 32 blocks]),
    on `threads` threads (default: the cores this process may run on)."""
    name = name.upper()
    target = _rewrite(name)
    if target is None:
        raise ValueError(f"no transcoding for {name}")
    fmt, rewrite = FORMATS[target[0]], target[1]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    out = np.empty((rows, k // BLOCK * fmt.block_bytes), dtype=np.uint8)
    step = max(1, SLICE_VALUES // k)
    starts = range(0, rows, step)

    def rewrite_slice(first: int) -> None:
        out[first : first + step] = rewrite(raw[first : first + step], k)

    workers = min(len(starts), threads or _usable_cores())
    if workers <= 1:
        for first in starts:
            rewrite_slice(first)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="transcode") as pool:
            list(pool.map(rewrite_slice, starts))  # the first failure is raised here
    return fmt, out


def _usable_cores() -> int:
    """The cores this process may run on (a worker's pinned ones), where the OS says."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _as_half_bytes(values: np.ndarray, what: str) -> np.ndarray:
    with np.errstate(over="ignore"):  # checked next
        half = values.astype(np.float16)
    if not np.isfinite(half).all():
        raise ValueError(f"a k-quant {what} does not fit a float16 (the file's scales are out of range)")
    return half[..., None].view(np.uint8)


def _k_quant_multipliers(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed bytes -> (scale multipliers, min multipliers), each [..., 8] in 0..63:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7; 4-7 in the nibbles of bytes
    8-11 with their top 2 bits in the top bits of bytes 0-3 and 4-7 (Q4_K's and Q5_K's)."""
    p = packed.astype(np.uint8)
    low, high = p[..., 0:4], p[..., 4:8]
    sc = np.concatenate([low & 63, (p[..., 8:12] & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mn = np.concatenate([high & 63, (p[..., 8:12] >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc, mn


def _k_quant_headers(blocks: np.ndarray) -> np.ndarray:
    """[rows, supers, bytes] of Q4_K or Q5_K -> each 32-value block's float16 scale and
    minimum bytes, [rows, supers, 8, 4]: d * sc and -dmin * m (exact in float32: 11 bits
    times 6), rounded to float16."""
    d, dmin = float16_values(blocks[..., 0:2]), float16_values(blocks[..., 2:4])
    sc, mn = _k_quant_multipliers(blocks[..., 4:16])
    return np.concatenate([_as_half_bytes(d[..., None] * sc, "block scale"),
                           _as_half_bytes(-dmin[..., None] * mn, "block minimum")], axis=-1)


def _low_nibble_pairs(qs: np.ndarray) -> np.ndarray:
    """[rows, supers, 128] k-quant nibbles -> [rows, supers, 8, 32]: 64 values a chunk of 32
    bytes, sub-block 2c in the low nibbles, 2c + 1 in the high."""
    chunks = qs.reshape(*qs.shape[:2], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=3).reshape(*qs.shape[:2], 8, 32)


def _block_nibbles(qs: np.ndarray) -> np.ndarray:
    """[rows, supers, 128] k-quant nibbles -> [rows, supers, 8, 16]: each 32-value block's
    bytes as Q4_1 and Q5_1 pack them, value i in byte i's low nibble, i + 16 in its high."""
    values = _low_nibble_pairs(qs)
    return (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8)


def _q4_k_as_q4_1(raw: np.ndarray, k: int) -> np.ndarray:
    rows, supers = raw.shape[0], k // SUPER
    blocks = raw.reshape(rows, supers, _Q4_K_BYTES)
    out = np.concatenate([_k_quant_headers(blocks), _block_nibbles(blocks[..., 16:])], axis=-1)
    return out.reshape(rows, k // BLOCK * FORMATS["Q4_1"].block_bytes)


def _q5_k_as_q5_1(raw: np.ndarray, k: int) -> np.ndarray:
    rows, supers = raw.shape[0], k // SUPER
    blocks = raw.reshape(rows, supers, _Q5_K_BYTES)
    # [rows, supers, 32 values, 8]: bit j of byte l is value l's fifth bit in sub-block j
    fifth = np.unpackbits(blocks[..., 16:48, None], axis=-1, bitorder="little")
    words = np.packbits(fifth.transpose(0, 1, 3, 2), axis=-1, bitorder="little")  # Q5_1's: bit l = value l
    out = np.concatenate([_k_quant_headers(blocks), words, _block_nibbles(blocks[..., 48:])], axis=-1)
    return out.reshape(rows, k // BLOCK * FORMATS["Q5_1"].block_bytes)


def _iq4_xs_as_iq4_nl(raw: np.ndarray, k: int) -> np.ndarray:
    rows, supers = raw.shape[0], k // SUPER
    blocks = raw.reshape(rows, supers, _IQ4_XS_BYTES)
    d = float16_values(blocks[..., 0:2])
    high = blocks[..., 2].astype(np.uint16) | blocks[..., 3].astype(np.uint16) << 8  # 2 bits a sub-block
    low = blocks[..., 4:8]  # a nibble a sub-block, sub-block 2i in byte i's low half
    lows = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(rows, supers, 8)
    highs = (high[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    multiplier = (lows | highs.astype(np.uint8) << 4).astype(np.float32) - 32
    scales = _as_half_bytes(d[..., None] * multiplier, "block scale")  # [rows, supers, 8, 2]
    nibbles = blocks[..., 8:].reshape(rows, supers, 8, 16)  # IQ4_NL's order already
    out = np.concatenate([scales, nibbles], axis=-1)
    return out.reshape(rows, k // BLOCK * FORMATS["IQ4_NL"].block_bytes)


def _requantized_as_q8_0(raw: np.ndarray, k: int, name: str) -> np.ndarray:
    """Requantized: the values of GGUF type `name` (the gguf package's) to Q8_0 blocks."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    with np.errstate(invalid="ignore", over="ignore"):  # checked next
        values = dequantize(raw, GGMLQuantizationType[name]).reshape(-1, k).astype(np.float32)
    if not np.isfinite(values).all():
        raise ValueError(f"a {name} block holds values that are not finite (the file's scales are corrupt)")
    with np.errstate(over="ignore"):  # checked next
        out = quantize(values, GGMLQuantizationType.Q8_0)
    scales = out.reshape(out.shape[0], -1, FORMATS["Q8_0"].block_bytes)[..., 0:2].copy().view(np.float16)
    if not np.isfinite(scales).all():
        raise ValueError(f"a {name} block's values reach past what a Q8_0 scale (float16) can hold")
    return out


# GGUF type -> (the format it becomes, the rewrite), for the formats whose quants are kept
_EXACT = {"Q4_K": ("Q4_1", _q4_k_as_q4_1), "Q5_K": ("Q5_1", _q5_k_as_q5_1), "IQ4_XS": ("IQ4_NL", _iq4_xs_as_iq4_nl)}


@cache
def _rewrite(name: str):
    """(target format name, rewrite) for GGUF type `name`, or None: the exact rewrites, else
    Q8_0 for any other block format the gguf package dequantizes (asked with one zero block)."""
    if name in _EXACT:
        return _EXACT[name]
    if name in FORMATS:
        return None
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType.__members__.get(name)
    if qtype is None or name in ("F32", "F16", "BF16", "F64") or qtype not in GGML_QUANT_SIZES:
        return None
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    if block_values % BLOCK:
        return None  # not blocks of 32 values or a multiple (I8, I32...)
    try:
        dequantize(np.zeros(block_bytes, np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return None
    return "Q8_0", partial(_requantized_as_q8_0, name=name)
