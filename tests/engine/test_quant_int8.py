"""int8 products on quantized weights with AVX512-VNNI or AVX2 (native/quant_int8.h): the values of
its arithmetic (each row's largest inputs multiplied in float, the rest rounded to int8 per
block of 32, exact integer sums, each block scaled once), close to the exact product, and
the weight's dispatch to it (a row's independence of its batch: test_quant_bf16.py, for
every panel engine). Each engine is skipped, naming why, where the library lacks it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine.native import quant as native_quant
from baton.engine.quant.formats import FORMATS, dequantize, split_blocks
from baton.engine.quant.weight import DenseProducts

from .quant_data import engine_here, native_weight, random_inputs, random_rows


@pytest.fixture(params=["avx512_vnni", "avx2_int8"])
def engine(request, lib):
    """Each int8 engine: AVX512-VNNI's, or AVX2's where the CPU has no VNNI (a library holds one)."""
    return engine_here(lib, request.param)


OUTLIERS = 4  # quant_int8.h's INT8_OUTLIERS


def _take_outliers(x: np.ndarray):
    """Each row's OUTLIERS largest |values| (the first of equals first): (where [rows, o],
    value [rows, o], the rest of x with zeros in their place)."""
    rest = x.astype(np.float32).copy()
    where = np.zeros((x.shape[0], OUTLIERS), dtype=np.int64)
    for o in range(OUTLIERS):
        where[:, o] = np.abs(rest).argmax(-1)
        rest[np.arange(x.shape[0]), where[:, o]] = 0  # (a zero row: its first value, zero)
    return where, np.take_along_axis(x.astype(np.float32), where, -1), rest


def _int8_inputs(x: np.ndarray):
    """Each block of 32: d = max|x| / 127, q = round-half-even(x / d) in -127..127 (by the
    reciprocal, in float32, as the kernel computes it), and d * sum(q)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inverse[..., None]), -127, 127).astype(np.int64)
    return q, d, (d * q.sum(-1).astype(np.float32)).astype(np.float32)


def _int8_reference(parts, x: torch.Tensor) -> torch.Tensor:
    """The kernel's values: each row's outliers taken out and multiplied exactly; the rest
    per block, d_w d_x sum(u q) + m d_x sum(q), the integer sums exact, the rest in float64
    (the kernel's float32 sums differ by rounding alone)."""
    where, value, rest = _take_outliers(x.numpy())
    q, dx, dsum = _int8_inputs(rest)
    columns = []
    for name, raw in parts:
        d, m, u = split_blocks(FORMATS[name], raw)
        dots = np.einsum("rbj,nbj->rnb", q, u.astype(np.int64)).astype(np.float64)
        scale = d.astype(np.float64)[None] * dx.astype(np.float64)[:, None]  # [rows, n, nb]
        blocks = (dots * scale).sum(-1) + dsum.astype(np.float64) @ m.astype(np.float64).T
        weights = dequantize(FORMATS[name], raw).astype(np.float64)  # [n, k]
        outliers = np.einsum("ro,nro->rn", value.astype(np.float64), weights[:, where])
        columns.append(blocks + outliers)
    return torch.from_numpy(np.concatenate(columns, axis=1)).float()


@pytest.mark.parametrize("name", list(FORMATS))
# partial and whole passes of 4 rows; the weights read in place up to 16 rows
# (INT8_IN_PLACE_ROWS), from panels past it
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 33, 40])
def test_product_matches_the_int8_arithmetic(lib, engine, name, rows):
    parts = [(name, random_rows(FORMATS[name], 37, 96, seed=rows))]  # 3 groups, the last partial
    x = random_inputs(rows, 96, seed=rows)
    w = native_weight(lib, parts)  # held: the matrix points into it
    got = native_quant.product_panels(lib, w.native_matrix, x, 37, engine)
    expected = _int8_reference(parts, x)
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("name", list(FORMATS))
def test_product_is_close_to_the_exact_one(lib, engine, name):
    raw = random_rows(FORMATS[name], 64, 256, seed=3)
    x = random_inputs(24, 256, seed=3)
    exact = x.double() @ torch.from_numpy(dequantize(FORMATS[name], raw)).double().t()
    w = native_weight(lib, [(name, raw)])
    got = native_quant.product_panels(lib, w.native_matrix, x, 64, engine).double()
    error = ((got - exact).norm() / exact.norm()).item()
    assert 0 < error < 1e-2, error  # int8 inputs: about 127 steps a block, not bf16's 256 a binade


def test_a_matrix_of_parts_in_three_formats(lib, engine):
    parts = [("Q4_0", random_rows(FORMATS["Q4_0"], 20, 64, 1)), ("Q8_0", random_rows(FORMATS["Q8_0"], 33, 64, 2)),
             ("Q4_1", random_rows(FORMATS["Q4_1"], 16, 64, 3))]
    x = random_inputs(21, 64, seed=4)
    expected = _int8_reference(parts, x)
    w = native_weight(lib, parts)
    got = native_quant.product_panels(lib, w.native_matrix, x, 69, engine)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("rows", [6, 36])  # in place, and from panels
def test_every_pairing_of_formats_in_one_pass(lib, engine, rows):
    """A pass takes two groups of 16 weight rows, each read by its own format: here a Q4_1
    group beside a Q8_0 one, a partial Q8_0 group beside a Q4_0 one, then two Q4_0 groups."""
    parts = [("Q4_1", random_rows(FORMATS["Q4_1"], 16, 64, 1)), ("Q8_0", random_rows(FORMATS["Q8_0"], 20, 64, 2)),
             ("Q4_0", random_rows(FORMATS["Q4_0"], 36, 64, 3))]
    x = random_inputs(rows, 64, seed=5)
    x[0, 56] = 50.0  # an outlier: value 24 of the second block, a 4-bit block's high nibble
    expected = _int8_reference(parts, x)
    w = native_weight(lib, parts)
    got = native_quant.product_panels(lib, w.native_matrix, x, 72, engine)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_zero_blocks_and_outliers(lib, engine):
    """A block of zeros has no scale (its products are zero, not NaN), and nothing
    overflows. A row's few huge values are taken out of its blocks before rounding: their
    small neighbours keep their int8 steps instead of rounding to zero, so the product stays
    as close to the exact one as a row without them."""
    parts = [("Q4_1", random_rows(FORMATS["Q4_1"], 16, 128, seed=5))]
    x = random_inputs(6, 128, seed=5)
    x[0] = 0
    x[1, :32] = 0
    x[2, 40] = 3e4
    x[3, [5, 6, 70, 100]] = torch.tensor([-2e3, 900.0, 4e3, -50.0])  # two in one block
    w = native_weight(lib, parts)
    got = native_quant.product_panels(lib, w.native_matrix, x, 16, engine)
    assert torch.isfinite(got).all() and torch.equal(got[0], torch.zeros(16))
    expected = _int8_reference(parts, x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    weights = torch.from_numpy(dequantize(FORMATS["Q4_1"], parts[0][1])).double()
    small = x.clone()
    small[2, 40] = 0
    small[3, [5, 6, 70, 100]] = 0
    for r in (2, 3):  # what is left is the small values' rounding: int8's ~1%, not a lost block
        error = (got[r].double() - x[r].double() @ weights.t()).norm() / (small[r].double() @ weights.t()).norm()
        assert error < 2e-2, (r, error.item())


def test_the_weight_sends_many_rows_to_the_int8_engine_and_few_to_the_int16_kernels(lib, engine, monkeypatch):
    parts = [("Q8_0", random_rows(FORMATS["Q8_0"], 24, 64, seed=8))]
    w = native_weight(lib, parts)
    w.dense = DenseProducts(torch.float32, min_rows=4, engine=engine)
    x = random_inputs(4, 64, seed=9)
    int16 = []
    monkeypatch.setattr(native_quant, "product", lambda *a: int16.append(a) or torch.zeros(a[2].shape[0], a[3]))
    monkeypatch.setattr(native_quant, "dequantize", lambda *a, **kw: pytest.fail("the dense path ran"))
    got = w.linear(x)
    assert not int16 and got.dtype == torch.float32
    expected = _int8_reference(parts, x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    w.linear(x[:3])
    assert len(int16) == 1  # below min_rows


