"""Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS encoders for tests (the `gguf` package reads them but
cannot write them): plain absmax or min/max scales, laid out as ggml's ggml-common.h lays
them out. Whether the layout is right is checked by reading the blocks back with the gguf
package."""

from __future__ import annotations

import numpy as np

from baton.engine.quant.formats import IQ4_NL_LEVELS

SUPER = 256


def _half(values: np.ndarray) -> np.ndarray:
    """float32 [...] -> ([..., 2] bytes of their float16, the float16 as float32)."""
    half = values.astype(np.float16)
    return half[..., None].view(np.uint8), half.astype(np.float32)


def _divide(x: np.ndarray, by: np.ndarray) -> np.ndarray:
    return np.divide(x, by, out=np.zeros(np.broadcast(x, by).shape, np.float32), where=by != 0)


def _min_scale_quants(x: np.ndarray, levels: int, largest_multiplier: int):
    """float32 [rows, supers, sub-blocks, values] -> (d bytes, dmin bytes, scale multipliers,
    min multipliers [..., sub-blocks], quants in 0..levels) for value = d sc q - dmin m per
    sub-block, the multipliers in 0..largest_multiplier (Q2_K, Q4_K, Q5_K)."""
    low = np.minimum(x.min(axis=-1), 0)
    scale, least = (x.max(axis=-1) - low) / levels, -low
    d_bytes, d = _half(scale.max(axis=-1) / largest_multiplier)
    m_bytes, dmin = _half(least.max(axis=-1) / largest_multiplier)
    sc = np.clip(np.rint(_divide(scale, d[..., None])), 0, largest_multiplier).astype(np.uint8)
    mn = np.clip(np.rint(_divide(least, dmin[..., None])), 0, largest_multiplier).astype(np.uint8)
    step, base = d[..., None] * sc, dmin[..., None] * mn
    q = np.clip(np.rint(_divide(x + base[..., None], step[..., None])), 0, levels).astype(np.uint8)
    return d_bytes, m_bytes, sc, mn, q


def _min_scale_blocks(values: np.ndarray, levels: int):
    """float32 [rows, k] -> (d, dmin bytes, packed 6-bit multipliers [..., 12], quants
    [rows, supers, 8, 32] in 0..levels) for value = d sc q - dmin m per 32 (Q4_K, Q5_K)."""
    rows, k = values.shape
    x = values.reshape(rows, k // SUPER, 8, 32).astype(np.float32)
    d_bytes, m_bytes, sc, mn, q = _min_scale_quants(x, levels, 63)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], axis=-1)
    return np.concatenate([d_bytes, m_bytes, packed], axis=-1), q


def _nibble_chunks(q: np.ndarray) -> np.ndarray:
    """[rows, supers, 8, 32] -> [rows, supers, 128]: sub-block 2c low, 2c + 1 high, per 32 bytes."""
    low = q & 0x0F
    return (low[..., 0::2, :] | (low[..., 1::2, :] << 4)).reshape(*q.shape[:2], 128)


def encode_q4_k(values: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> uint8 [rows, k / 256 * 144]: value = d sc q - dmin m per 32."""
    header, q = _min_scale_blocks(values, 15)
    return np.concatenate([header, _nibble_chunks(q)], axis=-1).reshape(values.shape[0], -1)


def encode_q5_k(values: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> uint8 [rows, k / 256 * 176]: as Q4_K with a fifth bit per value
    (byte l of 32: bit j for value l of sub-block j)."""
    header, q = _min_scale_blocks(values, 31)
    fifth = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2, dtype=np.uint8)  # [.., 32]
    return np.concatenate([header, fifth, _nibble_chunks(q)], axis=-1).reshape(values.shape[0], -1)


def encode_q6_k(values: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> uint8 [rows, k / 256 * 210]: value = d sc (q - 32) per 16."""
    rows, k = values.shape
    x = values.reshape(rows, k // SUPER, 16, 16).astype(np.float32)
    scale = np.abs(x).max(axis=-1) / 31
    d_bytes, d = _half(scale.max(axis=-1) / 127)
    sc = np.clip(np.rint(_divide(scale, d[..., None])), -128, 127).astype(np.int8)
    step = d[..., None] * sc
    q = np.clip(np.rint(_divide(x, step[..., None])) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(rows, k // SUPER, 2, 4, 32)  # halves of 128, in quarters of 32
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], axis=-1)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    supers = k // SUPER
    return np.concatenate([ql.reshape(rows, supers, 128), qh.reshape(rows, supers, 64),
                           sc.view(np.uint8), d_bytes], axis=-1).reshape(rows, -1)


def _two_bit_chunks(q: np.ndarray) -> np.ndarray:
    """[rows, supers, 16, 16] 2-bit quants -> [rows, supers, 64]: byte l of each 32-byte half
    holds values l, l + 32, l + 64, l + 96 of that half's 128, at shifts 0, 2, 4, 6."""
    q = q.reshape(*q.shape[:2], 2, 4, 32)
    return (q << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2, dtype=np.uint8).reshape(*q.shape[:2], 64)


def encode_q2_k(values: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> uint8 [rows, k / 256 * 84]: value = d sc q - dmin m per 16, q in
    0..3, sc and m 4-bit (one byte a sub-block: sc low, m high)."""
    rows, k = values.shape
    x = values.reshape(rows, k // SUPER, 16, 16).astype(np.float32)
    d_bytes, m_bytes, sc, mn, q = _min_scale_quants(x, 3, 15)
    return np.concatenate([sc | (mn << 4), _two_bit_chunks(q), d_bytes, m_bytes], axis=-1).reshape(rows, -1)


def encode_q3_k(values: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> uint8 [rows, k / 256 * 110]: value = d (sc - 32) q per 16, q in
    -4..3 stored as q + 4 (low 2 bits packed as Q2_K's, the third in a 32-byte mask: bit j
    of byte l for value 32 j + l), sc 6-bit (low nibbles in bytes 0-7, high 2 bits in 8-11)."""
    rows, k = values.shape
    supers = k // SUPER
    x = values.reshape(rows, supers, 16, 16).astype(np.float32)
    scale = _signed_steps(x) * 127 / 4  # the largest |value| to -4 (the levels reach -4 but only +3)
    d_bytes, d = _half(np.abs(scale).max(axis=-1) / 31)
    sc = np.clip(np.rint(_divide(scale, d[..., None])), -32, 31).astype(np.int32)
    u = (np.clip(np.rint(_divide(x, (d[..., None] * sc)[..., None])), -4, 3) + 4).astype(np.uint8)
    hmask = ((u >> 2).reshape(rows, supers, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2, dtype=np.uint8)
    stored = (sc + 32).astype(np.uint8)  # [.., 16]
    lows = (stored[..., :8] & 0x0F) | ((stored[..., 8:] & 0x0F) << 4)
    highs = ((stored >> 4).reshape(rows, supers, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(
        axis=-2, dtype=np.uint8)
    return np.concatenate([hmask, _two_bit_chunks(u & 3), lows, highs, d_bytes], axis=-1).reshape(rows, -1)


def _nearest_levels(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Each value's index among IQ4_NL's 16 levels nearest x / step, as uint8."""
    target = _divide(x, step[..., None])
    levels = np.array(IQ4_NL_LEVELS, dtype=np.float32)
    return np.abs(target[..., None] - levels).argmin(axis=-1).astype(np.uint8)


def _iq4_nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 32] indices -> [..., 16] bytes: value j low, j + 16 high (as Q4_0)."""
    return q[..., :16] | (q[..., 16:] << 4)


def _signed_steps(x: np.ndarray) -> np.ndarray:
    """Per block of the last axis, the step that takes its largest |value| to level -127
    (the levels reach -127 but only +113)."""
    largest = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    return -largest / 127


def encode_iq4_nl(values: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> uint8 [rows, k / 32 * 18]: value = d K[q] per 32."""
    rows, k = values.shape
    x = values.reshape(rows, k // 32, 32).astype(np.float32)
    d_bytes, d = _half(_signed_steps(x))
    return np.concatenate([d_bytes, _iq4_nibbles(_nearest_levels(x, d))], axis=-1).reshape(rows, -1)


def encode_iq4_xs(values: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> uint8 [rows, k / 256 * 136]: value = d (ls - 32) K[q] per 32, ls a
    6-bit multiplier (low nibbles packed two a byte, high 2 bits in a 16-bit word)."""
    rows, k = values.shape
    x = values.reshape(rows, k // SUPER, 8, 32).astype(np.float32)
    scale = _signed_steps(x)
    d_bytes, d = _half(np.abs(scale).max(axis=-1) / 31)
    ls = np.clip(np.rint(_divide(scale, d[..., None])), -32, 31).astype(np.int32) + 32
    q = _nearest_levels(x, d[..., None] * (ls - 32))
    low = (ls & 0x0F).astype(np.uint8)
    scales_l = low[..., 0::2] | (low[..., 1::2] << 4)  # [.., 4]
    scales_h = ((ls >> 4) << (2 * np.arange(8))).sum(axis=-1).astype(np.uint16)  # [..]
    return np.concatenate([d_bytes, scales_h[..., None].view(np.uint8), scales_l,
                           _iq4_nibbles(q).reshape(rows, k // SUPER, 128)], axis=-1).reshape(rows, -1)
