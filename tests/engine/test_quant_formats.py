"""The block formats, their CPU layout and the int16 input rows, against ggml's definitions
(the `gguf` package's quantize/dequantize) and against plain float arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from baton.engine.quant.activations import product_reference, quantize_rows
from baton.engine.quant.formats import (
    FORMATS,
    IQ4_NL_LEVELS,
    UnsupportedQuantization,
    dequantize,
    format_named,
    split_blocks,
)
from baton.engine.quant.interleave import ROWS, deinterleave, interleave
from baton.engine.quant.torch_blocks import dequantize_rows

from .kquant_encode import encode_iq4_nl
from .quant_data import random_rows

NAMES = list(FORMATS)


LINEAR = [name for name in NAMES if not FORMATS[name].lookup]  # those the gguf package can also write


def _gguf_rows(name: str, rows: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(float32 values, their GGUF blocks) quantized by the gguf package itself."""
    values = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    return values, gguf_quantize(values, GGMLQuantizationType[name])


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_matches_ggml_bit_for_bit(name):
    fmt = FORMATS[name]
    written = [_gguf_rows(name, 7, 96)[1]] if name in LINEAR else [encode_iq4_nl(_gguf_rows("Q8_0", 7, 96)[0])]
    for raw in (*written, random_rows(fmt, 7, 96, seed=1)):
        expected = gguf_dequantize(raw, GGMLQuantizationType[name]).reshape(7, 96)
        np.testing.assert_array_equal(dequantize(fmt, raw), expected)
        np.testing.assert_array_equal(dequantize_rows(fmt, torch.from_numpy(raw)).numpy(), expected)


@pytest.mark.parametrize("name", LINEAR)
def test_ggml_quantization_is_within_one_step(name):
    values, raw = _gguf_rows(name, 4, 64)
    fmt = FORMATS[name]
    d = np.abs(dequantize(fmt, raw) - values).reshape(4, 2, 32).max(axis=-1)
    scales = raw.reshape(4, 2, fmt.block_bytes)[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    assert (d <= np.abs(scales) * 0.5 + 1e-3).all()  # half a quantization step (+ float16 scale rounding)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows", [1, 16, 21, 40])
def test_interleaving_keeps_every_byte_and_round_trips(name, rows):
    fmt = FORMATS[name]
    raw = random_rows(fmt, rows, 64, seed=rows)
    data = interleave(fmt, raw)
    assert data.nbytes == -(-rows // ROWS) * ROWS * raw.shape[1]  # padding only to whole groups
    np.testing.assert_array_equal(deinterleave(fmt, data, rows, 64), raw)


def test_interleaved_layout_puts_a_row_in_one_lane():
    fmt = FORMATS["Q4_1"]
    raw = random_rows(fmt, 16, 32)
    data = interleave(fmt, raw)
    row = 5
    assert bytes(data[2 * row : 2 * row + 2]) == bytes(raw[row, 0:2])  # its scale
    assert bytes(data[32 + 2 * row : 34 + 2 * row]) == bytes(raw[row, 2:4])  # its minimum
    chunk1 = 64 + 64 * 1 + 4 * row  # quant bytes 4..7 of its block
    assert bytes(data[chunk1 : chunk1 + 4]) == bytes(raw[row, 8:12])


def test_q8_quants_are_stored_unsigned():
    fmt = FORMATS["Q8_0"]
    raw = random_rows(fmt, 16, 32)
    data = interleave(fmt, raw)
    assert data[32 + 4 * 3] == raw[3, 2] ^ 0x80


def test_5_bit_fifth_bits_are_worth_16_and_stored_beside_their_nibbles():
    fmt = FORMATS["Q5_1"]
    raw = random_rows(fmt, 16, 32, seed=9)
    raw[:, 4:8] = 0
    raw[3, 4:8] = np.array([1 << 2 | 1 << 5, 0, 1 << 1, 1 << 7], dtype=np.uint8)  # values 2, 5, 17 and 31
    d, m, u = split_blocks(fmt, raw)
    nibbles = np.concatenate([raw[3, 8:] & 0x0F, raw[3, 8:] >> 4])
    np.testing.assert_array_equal(u[3, 0] - nibbles, [16 if j in (2, 5, 17, 31) else 0 for j in range(32)])
    data = interleave(fmt, raw)
    word = data[64 + 4 * 3 : 64 + 4 * 4]  # row 3's, after 16 d and 16 m
    # byte b, bit j: value 4j + b; bit 4 + j: value 16 + 4j + b (the nibbles' chunk order)
    assert list(word) == [0, 1 << 1 | 1 << 4, 1 << 0, 1 << 7]  # 5: byte 1 bit 1, 17: byte 1 bit 4, 2: byte 2 bit 0, 31: byte 3 bit 7


@pytest.mark.parametrize("name", ["Q2_K", "IQ3_S", "F8"])
def test_an_unsupported_format_is_named(name):
    with pytest.raises(UnsupportedQuantization, match=rf"{name} \(tensor blk\.0\.ffn_down\.weight\).*--quantization none"):
        format_named(name, "blk.0.ffn_down.weight", also=("Q4_K",))
    with pytest.raises(UnsupportedQuantization, match=r"supported: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K\)"):
        format_named(name, also=("Q4_K",))


def test_input_rows_quantize_within_half_a_step():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 96)).astype(np.float32) * np.array([1e-3, 1.0, 50.0], dtype=np.float32)[:, None]
    x[0, :32] = 0.0  # an all-zero block
    qx = quantize_rows(x)
    assert np.abs(qx.q.astype(np.int32)).max() <= 32767
    assert qx.d[0, 0] == 0 and not qx.q[0, :32].any()
    back = qx.q.reshape(3, 3, 32) * qx.d[..., None]
    assert (np.abs(back - x.reshape(3, 3, 32)) <= qx.d[..., None] * 0.5 * (1 + 1e-6)).all()
    np.testing.assert_array_equal(qx.sums, qx.q.reshape(3, 3, 32).astype(np.int32).sum(-1))


@pytest.mark.parametrize("name", NAMES)
def test_the_int16_product_is_the_float_product_up_to_input_rounding(name):
    fmt = FORMATS[name]
    raw = random_rows(fmt, 24, 128, seed=7)
    x = np.random.default_rng(8).standard_normal((2, 128)).astype(np.float32)
    d, m, u = split_blocks(fmt, raw)  # the weights in float64: d * u + m exactly (float32 rounds those with a minimum)
    weights = (d[..., None].astype(np.float64) * u + m[..., None].astype(np.float64)).reshape(24, 128)
    exact = x.astype(np.float64) @ weights.T
    qx = quantize_rows(x)
    # each input value moves at most half its block's step: bound the product's change
    bound = (np.abs(weights).reshape(24, 4, 32).sum(-1) * qx.d[:, None] * 0.5).sum(-1) * (1 + 1e-6)
    got = product_reference(fmt, raw, x)
    assert (np.abs(got - exact) <= bound).all()
    x_rounded = (qx.q.reshape(2, 4, 32) * qx.d[..., None].astype(np.float64)).reshape(2, 128)
    np.testing.assert_allclose(got, x_rounded @ weights.T, rtol=1e-9, atol=1e-9)


def test_iq4_nl_nibbles_stand_for_its_16_levels():
    fmt = FORMATS["IQ4_NL"]
    raw = random_rows(fmt, 2, 32, seed=4)
    raw[0, 2:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)  # each index twice
    d = raw[0, 0:2].copy().view(np.float16).astype(np.float32)
    levels = np.array(IQ4_NL_LEVELS, dtype=np.float32)
    np.testing.assert_array_equal(dequantize(fmt, raw)[0], d * np.concatenate([levels, levels[::-1]]))
