"""GGUF formats rewritten at load (quant/transcode.py), against the `gguf` package's own
dequantization of the source blocks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from baton.engine.quant.formats import FORMATS, dequantize
from baton.engine.quant.transcode import (
    requantized,
    rewritten_formats,
    transcode,
    transcoded_format,
)

from . import kquant_encode as encoders

# where each source format keeps its float16 scales: (offset of d, offset of its min or None)
_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None), "Q5_0": (0, None), "Q5_1": (0, 2),
           "IQ4_XS": (0, None), "Q2_K": (80, 82), "Q3_K": (108, None), "IQ2_XXS": (0, None),
           "IQ3_S": (0, None), "TQ2_0": (64, None), "MXFP4": (None, None)}


def random_source_rows(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes] of GGUF type `name`: random quants and multipliers, float16
    scales of mixed sign and magnitude where ggml keeps them."""
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    rng = np.random.default_rng(seed)
    nb = k // block_values
    blocks = rng.integers(0, 256, size=(rows, nb, block_bytes), dtype=np.uint8)
    d_at, m_at = _SCALES[name]
    if name == "MXFP4":  # a power-of-two scale byte (E8M0), 2^-9 to 2^-1
        blocks[..., 0] = rng.integers(118, 127, size=(rows, nb), dtype=np.uint8)
    else:
        blocks[..., d_at : d_at + 2] = (rng.standard_normal((rows, nb, 1)) * 0.01).astype(np.float16).view(np.uint8)
    if m_at is not None:
        blocks[..., m_at : m_at + 2] = (rng.standard_normal((rows, nb, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _reference(name: str, raw: np.ndarray, k: int) -> np.ndarray:
    return gguf_dequantize(raw, GGMLQuantizationType[name]).reshape(raw.shape[0], k)


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1"])
def test_llama_cpp_s_5_bit_fallbacks_are_read_as_they_are(name):
    """Not rewritten: the kernels read them (their values against ggml's: test_quant_formats)."""
    assert transcoded_format(name) is None and name in FORMATS
    raw = random_source_rows(name, 5, 96, seed=6)
    np.testing.assert_array_equal(dequantize(FORMATS[name], raw), _reference(name, raw, 96))


@pytest.mark.parametrize("name, target, largest_quant", [("Q4_K", "Q4_1", 15), ("Q5_K", "Q5_1", 31)])
def test_k_quants_keep_their_quants_with_block_scales_rounded_to_float16(name, target, largest_quant):
    raw = random_source_rows(name, 6, 512, seed=2)
    fmt, out = transcode(name, raw, 512)
    assert fmt is FORMATS[target] and out.shape == (6, 16 * fmt.block_bytes)
    got, expected = dequantize(fmt, out), _reference(name, raw, 512)
    # each block's scale and minimum move by at most 2^-11 of themselves
    blocks = out.reshape(6, 16, fmt.block_bytes)
    scale = np.abs(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    least = np.abs(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    bound = np.repeat((scale * largest_quant + least) * 2.0**-11 + 1e-9, 32, axis=-1)
    assert (np.abs(got - expected) <= bound).all()
    assert np.abs(got - expected).max() > 0  # the rounding is real: this test can see it


def test_iq4_xs_keeps_its_indices_with_block_scales_rounded_to_float16():
    raw = random_source_rows("IQ4_XS", 6, 512, seed=2)
    fmt, out = transcode("IQ4_XS", raw, 512)
    assert fmt is FORMATS["IQ4_NL"] and out.shape == (6, 16 * fmt.block_bytes)
    got, expected = dequantize(fmt, out), _reference("IQ4_XS", raw, 512)
    scale = np.abs(out.reshape(6, 16, 18)[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    bound = np.repeat(scale * 127 * 2.0**-11 + 1e-9, 32, axis=-1)  # the block scale's rounding, at the largest level
    assert (np.abs(got - expected) <= bound).all()
    assert np.abs(got - expected).max() > 0


@pytest.mark.parametrize("name", ["Q6_K", "Q2_K", "Q3_K", "IQ2_XXS", "IQ3_S", "TQ2_0", "MXFP4"])
def test_formats_without_a_kernel_or_an_exact_rewrite_are_requantized_within_half_a_q8_0_step(name):
    k = 512
    raw = random_source_rows(name, 4, k, seed=3)
    fmt, out = transcode(name, raw, k)
    assert fmt is FORMATS["Q8_0"] and requantized(name)
    expected = _reference(name, raw, k)
    absmax = np.abs(expected).reshape(4, -1, 32).max(axis=-1)
    error = np.abs(dequantize(fmt, out) - expected).reshape(4, -1, 32).max(axis=-1)
    # half a step of absmax / 127, plus ggml's Q8_0 scale rounded to float16 after the quants
    assert (error <= absmax * (0.5 / 127 + 2.0**-11) + 1e-7).all()
    assert absmax.min() > 0  # random blocks with values in every one: the bound was tested


@pytest.mark.parametrize("value, message", [(np.inf, "not finite"), (65504.0, "past what a Q8_0 scale")])
def test_a_requantized_block_that_q8_0_cannot_hold_is_refused_naming_its_format(value, message):
    raw = random_source_rows("Q3_K", 2, 256, seed=1)
    raw[1, 108:110] = np.array([value], np.float16).view(np.uint8)  # d: infinite, or float16's largest
    raw[1, 96:108] = 0  # every sub-block's multiplier at -32: values up to 128 d
    with pytest.raises(ValueError, match=f"a Q3_K block.*{message}"):
        transcode("Q3_K", raw, 256)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q3_K"])
def test_rows_are_rewritten_in_slices_on_threads_the_same_as_whole(monkeypatch, name):
    import baton.engine.quant.transcode as transcode_module

    raw = random_source_rows(name, 9, 256, seed=4)
    whole = transcode(name, raw, 256, threads=1)[1]
    monkeypatch.setattr(transcode_module, "SLICE_VALUES", 2 * 256)  # two rows a slice, the last alone
    np.testing.assert_array_equal(transcode(name, raw, 256, threads=1)[1], whole)
    np.testing.assert_array_equal(transcode(name, raw, 256, threads=3)[1], whole)


def test_a_failing_slice_fails_the_whole_rewrite(monkeypatch):
    import baton.engine.quant.transcode as transcode_module

    raw = random_source_rows("Q4_K", 9, 256)
    raw[7, 0:2] = np.array([60000], np.float16).view(np.uint8)  # row 7's scale past float16 once multiplied
    raw[7, 4] = 63
    monkeypatch.setattr(transcode_module, "SLICE_VALUES", 2 * 256)
    with pytest.raises(ValueError, match="does not fit a float16"):
        transcode("Q4_K", raw, 256, threads=3)


def test_the_test_encoders_write_blocks_ggml_reads_back_within_a_step():
    values = np.random.default_rng(5).standard_normal((3, 512)).astype(np.float32) * 0.05
    for name, levels in (("Q4_K", 15), ("Q5_K", 31), ("Q6_K", 63), ("Q2_K", 3), ("Q3_K", 7)):
        encode = getattr(encoders, f"encode_{name.lower()}")
        decoded = _reference(name, encode(values), 512)
        span = np.ptp(values.reshape(3, -1, 16), axis=-1).max()
        assert np.abs(decoded - values).max() <= span / levels * 1.5, name
    for name in ("IQ4_NL", "IQ4_XS"):  # levels up to 24 apart, of 127
        encode = getattr(encoders, f"encode_{name.lower()}")
        decoded = _reference(name, encode(values), 512)
        absmax = np.abs(values.reshape(3, -1, 256)).max(axis=-1, keepdims=True)
        assert (np.abs(decoded - values).reshape(3, -1, 256) <= absmax * 14 / 127).all(), name


def test_three_formats_keep_their_quants_and_every_other_block_format_is_requantized():
    rewritten = rewritten_formats()
    assert rewritten[:3] == ("Q4_K", "Q5_K", "IQ4_XS") and not any(requantized(n) for n in rewritten[:3])
    assert {"Q2_K", "Q3_K", "Q6_K", "IQ1_M", "IQ2_XXS", "IQ3_S", "TQ1_0", "MXFP4"} <= set(rewritten)
    assert all(transcoded_format(n) is FORMATS["Q8_0"] for n in rewritten[3:])
    assert transcoded_format("q4_k") is FORMATS["Q4_1"] and transcoded_format("Q5_K") is FORMATS["Q5_1"]
    for read_as_they_are in FORMATS:
        assert transcoded_format(read_as_they_are) is None
    for not_blocks in ("F32", "F16", "BF16", "I8", "I32", "Q8_K", "NOT_A_TYPE"):  # Q8_K: ggml's activations only
        assert transcoded_format(not_blocks) is None
    with pytest.raises(ValueError, match="no transcoding for Q8_K"):
        transcode("Q8_K", np.zeros((1, 292), np.uint8), 256)


def test_a_q4_k_scale_past_float16_is_refused_naming_it():
    raw = random_source_rows("Q4_K", 1, 256)
    raw[0, 0:2] = np.array([60000], np.float16).view(np.uint8)  # d near float16's largest
    raw[0, 4] = 63  # first sub-block's multiplier at its largest
    with pytest.raises(ValueError, match="k-quant block scale does not fit a float16"):
        transcode("Q4_K", raw, 256)
