"""int8 products on quantized weights with AVX512-VNNI (native/quant_int8.h): the values of
its arithmetic (inputs rounded to int8 per block of 32, exact integer sums, each block
scaled once), close to the exact product, and the weight's dispatch to it (a row's
independence of its batch: test_quant_bf16.py, for every panel engine). Skipped, naming
why, where the library has no VNNI engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine.cpu_features import this_cpu
from baton.engine.native import quant as native_quant
from baton.engine.quant.formats import FORMATS, dequantize, split_blocks
from baton.engine.quant.weight import DenseProducts

from .quant_data import native_weight, random_inputs, random_rows

ENGINE = "avx512_vnni"


@pytest.fixture
def vnni(lib):
    if ENGINE not in native_quant.panel_engines(lib):
        has = "avx512_vnni" in this_cpu().flags
        pytest.skip("no int8 products here: " + ("the library was built without VNNI" if has
                                                 else "this CPU has no AVX512-VNNI (avx512_vnni)"))
    return lib


def _int8_inputs(x: np.ndarray):
    """Each block of 32: d = max|x| / 127, q = round-half-even(x / d) in -127..127 (by the
    reciprocal, in float32, as the kernel computes it), and d * sum(q)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inverse[..., None]), -127, 127).astype(np.int64)
    return q, d, (d * q.sum(-1).astype(np.float32)).astype(np.float32)


def _int8_reference(parts, x: torch.Tensor) -> torch.Tensor:
    """The kernel's values: per block, d_w d_x sum(u q) + m d_x sum(q), the integer sums
    exact, the rest in float64 (the kernel's float32 sums differ by rounding alone)."""
    q, dx, dsum = _int8_inputs(x.numpy())
    columns = []
    for name, raw in parts:
        d, m, u = split_blocks(FORMATS[name], raw)
        dots = np.einsum("rbj,nbj->rnb", q, u.astype(np.int64)).astype(np.float64)
        scale = d.astype(np.float64)[None] * dx.astype(np.float64)[:, None]  # [rows, n, nb]
        columns.append((dots * scale).sum(-1) + dsum.astype(np.float64) @ m.astype(np.float64).T)
    return torch.from_numpy(np.concatenate(columns, axis=1)).float()


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 40])  # partial and whole passes of 4 rows
def test_product_matches_the_int8_arithmetic(vnni, name, rows):
    parts = [(name, random_rows(FORMATS[name], 37, 96, seed=rows))]  # 3 groups, the last partial
    x = random_inputs(rows, 96, seed=rows)
    w = native_weight(vnni, parts)  # held: the matrix points into it
    got = native_quant.product_panels(vnni, w.native_matrix, x, 37, ENGINE)
    expected = _int8_reference(parts, x)
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("name", list(FORMATS))
def test_product_is_close_to_the_exact_one(vnni, name):
    raw = random_rows(FORMATS[name], 64, 256, seed=3)
    x = random_inputs(24, 256, seed=3)
    exact = x.double() @ torch.from_numpy(dequantize(FORMATS[name], raw)).double().t()
    w = native_weight(vnni, [(name, raw)])
    got = native_quant.product_panels(vnni, w.native_matrix, x, 64, ENGINE).double()
    error = ((got - exact).norm() / exact.norm()).item()
    assert 0 < error < 1e-2, error  # int8 inputs: about 127 steps a block, not bf16's 256 a binade


def test_a_matrix_of_parts_in_three_formats(vnni):
    parts = [("Q4_0", random_rows(FORMATS["Q4_0"], 20, 64, 1)), ("Q8_0", random_rows(FORMATS["Q8_0"], 33, 64, 2)),
             ("Q4_1", random_rows(FORMATS["Q4_1"], 16, 64, 3))]
    x = random_inputs(21, 64, seed=4)
    expected = _int8_reference(parts, x)
    w = native_weight(vnni, parts)
    got = native_quant.product_panels(vnni, w.native_matrix, x, 69, ENGINE)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_zero_blocks_and_outliers(vnni):
    """A block of zeros has no scale (its products are zero, not NaN); a block with one huge
    value rounds its small ones to zero, as int8 must, and nothing overflows."""
    parts = [("Q4_1", random_rows(FORMATS["Q4_1"], 16, 128, seed=5))]
    x = random_inputs(6, 128, seed=5)
    x[0] = 0
    x[1, :32] = 0
    x[2, 40] = 3e4
    w = native_weight(vnni, parts)
    got = native_quant.product_panels(vnni, w.native_matrix, x, 16, ENGINE)
    assert torch.isfinite(got).all() and torch.equal(got[0], torch.zeros(16))
    expected = _int8_reference(parts, x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_the_weight_sends_many_rows_to_the_int8_engine_and_few_to_the_int16_kernels(vnni, monkeypatch):
    parts = [("Q8_0", random_rows(FORMATS["Q8_0"], 24, 64, seed=8))]
    w = native_weight(vnni, parts)
    w.dense = DenseProducts(torch.float32, min_rows=4, engine=ENGINE)
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


