"""The Triton matmul on quantized GGUF rows against torch: x @ dequantize(W)^T.

On CPU under TRITON_INTERPRET=1 (tests/kernels/conftest.py), so the shapes are tiny; with
BATON_TRITON_DEVICE=cuda the same cases run compiled, plus a model-sized one."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; Triton kernel tests skipped")

from baton.engine.kernels.triton.quant_matmul import quant_matmul  # noqa: E402
from baton.engine.quant.formats import BLOCK, FORMATS  # noqa: E402
from baton.engine.quant.torch_blocks import dequantize_rows  # noqa: E402
from baton.engine.quant.weight import QuantizedTensor, QuantizedWeight  # noqa: E402

ON_GPU = os.environ.get("BATON_TRITON_DEVICE") == "cuda"
SHAPES = [(1, 40, 64), (5, 70, 32)]  # (rows of x, rows of W, K): partial tiles of 16 and 64
if ON_GPU:
    SHAPES += [(1, 3072, 576), (64, 576, 1536)]


def random_rows(fmt, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF rows with every quant byte and float16 scales (minimums) of both signs."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, k // BLOCK, fmt.block_bytes), dtype=np.uint8)
    for offset in (0, 2) if fmt.has_min else (0,):
        scale = (rng.standard_normal((rows, k // BLOCK)) * 0.05).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def _weight(parts, device):
    w = QuantizedWeight([QuantizedTensor(FORMATS[name], raw, raw.shape[1] // FORMATS[name].block_bytes * 32)
                         for name, raw in parts])
    return w.to(device)


def _reference(parts, x, weights_in=torch.float32):
    """x @ W^T in float64 on the weights the kernel multiplies: the blocks' values, rounded to
    `weights_in` (on a GPU, bf16 inputs meet bf16 weights in the tensor cores), and each
    output's sum of |terms| (what its float32 accumulation's rounding grows with)."""
    dense = torch.cat([dequantize_rows(FORMATS[name], torch.from_numpy(raw)) for name, raw in parts])
    x64, w64 = x.float().cpu().double(), dense.to(weights_in).double()
    return (x64 @ w64.t()).float(), (x64.abs() @ w64.abs().t()).float()


def _weights_in(dtype, device) -> torch.dtype:
    """The dtype the kernel's products take the weights in (quant_matmul's dot_fp32)."""
    return torch.float32 if dtype == torch.float32 or device.type != "cuda" else dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_quant_matmul_matches_torch(name, m, n, k, dtype, kernel_device, check):
    parts = [(name, random_rows(FORMATS[name], n, k, seed=n + k))]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = quant_matmul(x.to(kernel_device), _weight(parts, kernel_device))
    expected, magnitude = _reference(parts, x, _weights_in(dtype, kernel_device))
    if dtype == torch.bfloat16:  # bf16 inputs: check at bf16's precision
        got, expected = got.to(dtype), expected.to(dtype)
    check(f"quant_matmul_{name}", got.cpu(), expected, magnitude)


def test_quant_matmul_on_parts_of_three_formats(kernel_device, check):
    parts = [("Q4_0", random_rows(FORMATS["Q4_0"], 20, 64, 1)), ("Q8_0", random_rows(FORMATS["Q8_0"], 7, 64, 2)),
             ("Q4_1", random_rows(FORMATS["Q4_1"], 17, 64, 3))]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    got = quant_matmul(x.to(kernel_device), _weight(parts, kernel_device))
    check("quant_matmul_parts", got.cpu(), *_reference(parts, x))


def test_a_matrix_rearranged_for_the_cpu_is_refused():
    from baton.engine.native import build

    lib = build.load()
    if lib is None:
        pytest.skip("no native library to rearrange for")
    w = _weight([("Q4_1", random_rows(FORMATS["Q4_1"], 16, 32))], "cpu")
    w.use_native(lib)
    with pytest.raises(ValueError, match="rearranged for the CPU"):
        quant_matmul(torch.zeros(1, 32), w)
