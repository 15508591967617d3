"""The native int16 kernels on quantized weights against the numpy references, in every
variant this CPU can run (the one built for it, and the portable ones built for older
x86 CPUs: a CPU without AVX-512 or AVX2 gets those)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine.native import build
from baton.engine.native import quant as native_quant
from baton.engine.quant import weight as weight_module
from baton.engine.quant.activations import product_reference, quantize_rows
from baton.engine.quant.formats import FORMATS, dequantize
from baton.engine.quant.weight import DenseProducts, QuantizedTensor, QuantizedWeight

from .quant_data import random_rows

# -march level (native/build.py's LEVEL_FLAGS) -> the kernel it must compile to
VARIANTS = {"x86-64": "scalar", "x86-64-v3": "avx2", "x86-64-v4": "avx512"}


def _variant(march: str):
    if missing := build.missing_for(march):
        pytest.skip(f"this CPU lacks {', '.join(missing)} for -march={march}")
    lib = build.library_for(march)
    kernel = VARIANTS[march]
    assert native_quant.kernel_name(lib) == kernel
    assert native_quant.dequantize_kernel_name(lib) == kernel
    return lib


@pytest.fixture(scope="module", params=["native", *VARIANTS])
def lib(request):
    if request.param == "native":
        lib = build.load()
        if lib is None:
            pytest.skip(f"native library unavailable: {build.failure()}")
        return lib
    return _variant(request.param)


def _weight(lib, parts):
    w = QuantizedWeight([QuantizedTensor(FORMATS[name], raw, raw.shape[1] // FORMATS[name].block_bytes * 32)
                         for name, raw in parts])
    w.use_native(lib)
    return w


def _close(got: np.ndarray, expected: np.ndarray) -> None:
    # only the float scaling rounds: a few float32 ulps of the largest terms per block
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 6, 13])  # 13: a full pass of 8 rows (AVX-512) or 4, then a partial one
def test_product_matches_the_reference(lib, name, rows):
    raw = random_rows(FORMATS[name], 37, 96, seed=rows)  # 37: a partial last group of 16
    x = np.random.default_rng(rows).standard_normal((rows, 96)).astype(np.float32)
    w = _weight(lib, [(name, raw)])
    got = native_quant.product(lib, w.native_matrix, torch.from_numpy(x), 37).numpy()
    _close(got, product_reference(FORMATS[name], raw, x))


def test_a_matrix_of_parts_in_three_formats(lib):
    parts = [("Q4_0", random_rows(FORMATS["Q4_0"], 20, 64, 1)), ("Q8_0", random_rows(FORMATS["Q8_0"], 7, 64, 2)),
             ("Q4_1", random_rows(FORMATS["Q4_1"], 33, 64, 3))]
    x = np.random.default_rng(4).standard_normal((5, 64)).astype(np.float32)
    w = _weight(lib, parts)
    assert w.shape == (60, 64) and len(w.formats) == 3
    got = native_quant.product(lib, w.native_matrix, torch.from_numpy(x), 60).numpy()
    expected = np.concatenate([product_reference(FORMATS[n], raw, x) for n, raw in parts], axis=1)
    _close(got, expected)
    dense = np.concatenate([dequantize(FORMATS[n], raw) for n, raw in parts])
    np.testing.assert_array_equal(w.dequantize(18, 30).numpy(), dense[18:48])  # across part boundaries


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantized_rows_are_ggmls_bit_for_bit(lib, name):
    raw = random_rows(FORMATS[name], 21, 64, seed=9)
    w = _weight(lib, [(name, raw)])
    np.testing.assert_array_equal(w.dequantize(0, 21).numpy(), dequantize(FORMATS[name], raw))
    ids = torch.tensor([[20, 3], [3, 0]])
    np.testing.assert_array_equal(w.embedding(ids, torch.float32).numpy(), dequantize(FORMATS[name], raw)[ids.numpy()])


@pytest.mark.parametrize("name", list(FORMATS))
def test_bfloat16_tiles_are_the_float32_rows_rounded_as_torch_rounds(lib, name):
    raw = random_rows(FORMATS[name], 37, 96, seed=11)
    blocks = raw.reshape(37, 3, FORMATS[name].block_bytes)
    blocks[0, 1, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # a NaN scale stays NaN
    blocks[1, 2, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    blocks[2, 0, 0:2] = np.array([6e-8], dtype=np.float16).view(np.uint8)  # subnormal half
    w = _weight(lib, [(name, raw)])
    with np.errstate(invalid="ignore"):  # inf * 0
        expected = torch.from_numpy(dequantize(FORMATS[name], raw)).to(torch.bfloat16)
    got = native_quant.dequantize(lib, w.native_matrix, 0, 37, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    nan = torch.isnan(expected)
    assert nan.any() and torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    tile = torch.empty(5, 96, dtype=torch.bfloat16)
    assert torch.equal(native_quant.dequantize(lib, w.native_matrix, 30, 5, out=tile).view(torch.int16),
                       expected[30:35].view(torch.int16))


def test_dequantizing_into_a_tensor_of_the_wrong_kind_is_refused(lib):
    w = _weight(lib, [("Q8_0", random_rows(FORMATS["Q8_0"], 4, 64, seed=1))])
    for wrong in (torch.empty(4, 64, dtype=torch.float16), torch.empty(4, 32), torch.empty(64, 4).t()):
        with pytest.raises(ValueError, match="contiguous float32 or bfloat16"):
            native_quant.dequantize(lib, w.native_matrix, 0, 4, out=wrong)


def test_input_rows_quantize_as_the_reference(lib):
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32) * 3
    x[1, 32:] = 0.0
    q, d, sums = native_quant.quantize_input(lib, torch.from_numpy(x))
    expected = quantize_rows(x)
    np.testing.assert_array_equal(q.numpy(), expected.q)
    np.testing.assert_array_equal(d.numpy(), expected.d)
    np.testing.assert_array_equal(sums.numpy(), expected.sums)


def test_a_rows_result_does_not_depend_on_its_batch(lib):
    raw = random_rows(FORMATS["Q4_1"], 48, 160, seed=6)
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((11, 160)).astype(np.float32))
    w = _weight(lib, [("Q4_1", raw)])
    together = native_quant.product(lib, w.native_matrix, x, 48)
    for row in range(11):
        alone = native_quant.product(lib, w.native_matrix, x[row : row + 1], 48)
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_many_rows_run_as_dequantized_tiles_through_the_dense_gemm(lib, monkeypatch, dtype, tolerance):
    parts = [("Q4_0", random_rows(FORMATS["Q4_0"], 40, 64, 7)), ("Q4_1", random_rows(FORMATS["Q4_1"], 33, 64, 8))]
    w = _weight(lib, parts)
    w.dense = DenseProducts(dtype, min_rows=6)
    monkeypatch.setattr(weight_module, "DENSE_TILE_VALUES", 20 * 64)  # several tiles, the last partial
    dense = torch.from_numpy(np.concatenate([dequantize(FORMATS[n], raw) for n, raw in parts]))
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((6, 64)).astype(np.float32))
    calls = []
    monkeypatch.setattr(native_quant, "product", lambda *a: calls.append(a) or torch.zeros(a[2].shape[0], a[3]))
    got = w.linear(x)
    assert not calls  # six rows: the dense path, never the int16 kernels
    expected = x @ dense.t()
    assert got.dtype == torch.float32 and got.shape == (6, 73)
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()
    w.linear(x[:5])
    assert len(calls) == 1  # five rows: below min_rows, the int16 kernels


# -march level -> the panel engines its library holds: AVX2's int8 products wherever AVX2 is
# and AVX512-VNNI is not (x86-64-v4 has AVX-512 without VNNI)
PANEL_ENGINES = {"x86-64": [], "x86-64-v3": ["avx2_int8"], "x86-64-v4": ["avx2_int8"]}


@pytest.mark.parametrize("march", list(VARIANTS))
def test_each_portable_build_holds_the_int8_products_its_instructions_allow(march):
    lib = _variant(march)
    assert native_quant.panel_engines(lib) == PANEL_ENGINES[march]
    raw = random_rows(FORMATS["Q4_1"], 16, 64, seed=2)
    w = _weight(lib, [("Q4_1", raw)])
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32))
    if not PANEL_ENGINES[march]:
        with pytest.raises(RuntimeError, match="avx2_int8 unavailable here"):
            native_quant.product_panels(lib, w.native_matrix, x, 16, "avx2_int8")
        return
    got = native_quant.product_panels(lib, w.native_matrix, x, 16, "avx2_int8").double().numpy()
    exact = x.double().numpy() @ dequantize(FORMATS["Q4_1"], raw).astype(np.float64).T
    assert 0 < np.linalg.norm(got - exact) / np.linalg.norm(exact) < 1e-2  # int8 inputs' rounding, no more
