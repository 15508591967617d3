"""The native SwiGLU (decode_step.c's `baton_silu_and_mul_f32`) the torch path uses on CPU:
within an ulp or two of ref.silu_and_mul on float32 rows, widths with and without a tail past
the vector loop, values far into both tails of the sigmoid; other dtypes and layouts handed
to the op it wraps."""

from __future__ import annotations

import pytest
import torch

from baton.engine.kernels import ref
from baton.engine.native.swiglu import silu_and_mul_op


@pytest.mark.parametrize("rows, width", [(1, 1536), (256, 1536), (3, 37), (2, 16)])
def test_it_matches_the_torch_path(lib, rows, width):
    x = 4 * torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(0))
    got = silu_and_mul_op(lib, ref.silu_and_mul)(x)
    want = ref.silu_and_mul(x.double())
    assert got.dtype == torch.float32 and got.shape == (rows, width)
    torch.testing.assert_close(got.double(), want, rtol=4e-7, atol=1e-30)


def test_the_tails_of_the_sigmoid(lib):
    gate = torch.tensor([-1e4, -200.0, -88.5, -87.5, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 87.0, 88.5, 200.0, 1e4,
                         float("inf"), -float("inf"), 3.0])
    x = torch.cat((gate, torch.full_like(gate, 2.0)))[None]
    got = silu_and_mul_op(lib, ref.silu_and_mul)(x)[0]
    want = ref.silu_and_mul(x)[0]  # torch's float32: e^-x is infinite from x = -88.7
    finite = torch.isfinite(gate)
    # past x = -87 the AVX-512 form's sigmoid is 0 (its reciprocal would leave float's normal
    # range) where torch's is under 2e-38: here silu * up differs by under 4e-36
    torch.testing.assert_close(got[finite], want[finite], rtol=4e-7, atol=1e-35)
    assert got[gate == float("inf")].item() == float("inf")
    assert torch.isnan(got[gate == -float("inf")]).all() and torch.isnan(want[gate == -float("inf")]).all()


def test_other_dtypes_and_layouts_go_to_the_op_it_wraps(lib):
    calls = []

    def fallback(x):
        calls.append((x.dtype, x.is_contiguous()))
        return ref.silu_and_mul(x)

    swiglu = silu_and_mul_op(lib, fallback)
    x = torch.randn(4, 64)
    assert torch.equal(swiglu(x.bfloat16()), ref.silu_and_mul(x.bfloat16()))
    assert torch.equal(swiglu(x.t().contiguous().t()), ref.silu_and_mul(x.t().contiguous().t()))
    assert calls == [(torch.bfloat16, True), (torch.float32, False)]
