"""bf16 products on quantized weights, dequantized inside the product (native/quant_bf16.h),
on each engine this machine has (AVX512-BF16, AMX): the same values as the bf16 dense path
(its tiles, its rounding of the inputs), rows independent of their batch, and the weight's
dispatch. An engine the CPU or the OS does not give is skipped, naming why."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine.native import build
from baton.engine.native import quant as native_quant
from baton.engine.quant.formats import FORMATS
from baton.engine.quant.weight import DenseProducts, QuantizedWeight

from .quant_data import engine_here, native_weight, random_inputs, random_rows


@pytest.fixture(params=["avx512_bf16", "amx"])
def engine(request, lib):
    return engine_here(lib, request.param)


@pytest.fixture(params=["avx512_bf16", "amx", "avx512_vnni", "avx2_int8"])
def any_engine(request, lib):
    """Every panel engine, the int8 ones (quant_int8.h, test_quant_int8.py) included."""
    return engine_here(lib, request.param)


def _bf16_reference(lib, w: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """The dense bf16 path's values: its bf16 tiles and inputs, products summed in float64."""
    tiles = native_quant.dequantize(lib, w.native_matrix, 0, w.shape[0], dtype=torch.bfloat16)
    return (x.bfloat16().double() @ tiles.double().t()).float()


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40])  # partial and whole tiles of 16, one or two at once
def test_product_matches_the_bf16_dense_values(lib, engine, name, rows):
    w = native_weight(lib, [(name, random_rows(FORMATS[name], 37, 96, seed=rows))])  # 3 groups, the last partial
    x = random_inputs(rows, 96, seed=rows)
    got = native_quant.product_panels(lib, w.native_matrix, x, 37, engine)
    expected = _bf16_reference(lib, w, x)
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    # only the float32 sums round: a few ulps of the largest partial sums
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_a_matrix_of_parts_in_three_formats(lib, engine):
    parts = [("Q4_0", random_rows(FORMATS["Q4_0"], 20, 64, 1)), ("Q8_0", random_rows(FORMATS["Q8_0"], 33, 64, 2)),
             ("Q4_1", random_rows(FORMATS["Q4_1"], 16, 64, 3))]
    w = native_weight(lib, parts)
    x = random_inputs(21, 64, seed=4)
    expected = _bf16_reference(lib, w, x)
    torch.testing.assert_close(native_quant.product_panels(lib, w.native_matrix, x, 69, engine), expected,
                               rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_a_rows_result_does_not_depend_on_its_batch(lib, any_engine):
    w = native_weight(lib, [("Q4_1", random_rows(FORMATS["Q4_1"], 48, 128, seed=5))])
    x = random_inputs(35, 128, seed=6)
    together = native_quant.product_panels(lib, w.native_matrix, x, 48, any_engine)
    for row in (0, 3, 4, 7, 8, 16, 34):  # across passes of 4 (int8), 8 (AVX512-BF16), 16 (AMX) rows
        alone = native_quant.product_panels(lib, w.native_matrix, x[row : row + 1], 48, any_engine)
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_panels_hold_the_dense_paths_bits(lib, engine, name):
    """One-hot inputs read the panels back exactly (one product by 1.0, the rest zeros).
    4-bit blocks take a shortcut where the minimum minus 16 scales is exact in float32;
    here a third of the rows have minimums far from their scales (600 beside ~0.001, and
    3·2^-24 beside ~0.1), where it is not, and take the general path: the bits are the
    same either way."""
    raw = random_rows(FORMATS[name], 37, 96, seed=12)
    if FORMATS[name].has_min:
        blocks = raw.reshape(37, 3, FORMATS[name].block_bytes)
        rng = np.random.default_rng(13)
        for rows, scale, least in ((slice(0, None, 6), 1e-3, 600.0), (slice(3, None, 6), 0.1, 3 * 2.0**-24)):
            d = (rng.standard_normal(blocks[rows].shape[:2]) * scale).astype(np.float16)
            blocks[rows, :, 0:2] = d.view(np.uint8).reshape(*d.shape, 2)
            blocks[rows, :, 2:4] = np.full(d.shape, least, dtype=np.float16).view(np.uint8).reshape(*d.shape, 2)
        d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        m = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        inexact = (m - 16 * d).astype(np.float64) != m.astype(np.float64) - 16 * d.astype(np.float64)
        assert 10 < inexact.sum() < inexact.size  # both paths run
    w = native_weight(lib, [(name, raw)])
    dense = native_quant.dequantize(lib, w.native_matrix, 0, 37, dtype=torch.bfloat16).float()
    got = native_quant.product_panels(lib, w.native_matrix, torch.eye(96), 37, engine)
    assert torch.equal(got, dense.t())


def test_the_weight_sends_many_rows_to_its_engine_and_few_to_the_int16_kernels(lib, engine, monkeypatch):
    w = native_weight(lib, [("Q8_0", random_rows(FORMATS["Q8_0"], 24, 64, seed=7))])
    w.dense = DenseProducts(torch.bfloat16, min_rows=4, engine=engine)
    x = random_inputs(4, 64, seed=8)
    expected = _bf16_reference(lib, w, x)
    int16 = []
    monkeypatch.setattr(native_quant, "product", lambda *a: int16.append(a) or torch.zeros(a[2].shape[0], a[3]))
    monkeypatch.setattr(native_quant, "dequantize", lambda *a, **kw: pytest.fail("the dense path ran"))
    got = w.linear(x)
    assert not int16 and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    w.linear(x[:3])
    assert len(int16) == 1  # below min_rows


def test_a_library_built_without_bf16_instructions_says_so_and_refuses():
    if missing := build.missing_for("x86-64-v4"):
        pytest.skip(f"needs a CPU that runs -march=x86-64-v4 code (this one lacks {', '.join(missing)})")
    lib = build.library_for("x86-64-v4")
    # x86-64-v4 has neither AVX512-BF16 nor AVX512-VNNI: its int8 products are AVX2's
    assert native_quant.panel_engines(lib) == ["avx2_int8"]
    w = native_weight(lib, [("Q4_0", random_rows(FORMATS["Q4_0"], 16, 64, seed=9))])
    for engine in ("", "amx", "avx512_bf16", "avx512_vnni"):
        with pytest.raises(RuntimeError, match=f"{engine or 'every bf16 engine'} unavailable here"):
            native_quant.product_panels(lib, w.native_matrix, random_inputs(2, 64, seed=9), 16, engine)
    with pytest.raises(ValueError, match="unknown panel engine 'avx2'"):
        native_quant.product_panels(lib, w.native_matrix, random_inputs(2, 64, seed=9), 16, "avx2")
