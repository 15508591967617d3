"""Random quantized rows for the quantization tests: every quant value, sane scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine.cpu_features import this_cpu
from baton.engine.native import quant as native_quant
from baton.engine.quant.formats import BLOCK, FORMATS, BlockFormat
from baton.engine.quant.weight import QuantizedTensor, QuantizedWeight


def random_rows(fmt: BlockFormat, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: random quants (all 256 bytes, -128 included for Q8_0) and
    float16 scales and minimums of mixed sign and magnitude."""
    rng = np.random.default_rng(seed)
    nb = k // BLOCK
    blocks = rng.integers(0, 256, size=(rows, nb, fmt.block_bytes), dtype=np.uint8)
    d = (rng.standard_normal((rows, nb)) * 0.02).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    if fmt.has_min:
        m = (rng.standard_normal((rows, nb)) * 0.1).astype(np.float16)
        blocks[..., 2:4] = m.view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, -1)


def native_weight(lib, parts: list[tuple[str, np.ndarray]]) -> QuantizedWeight:
    """A weight of (format name, GGUF rows) parts stacked on the output axis, on the native
    library. Hold it while its `native_matrix` is in use: the matrix points into it."""
    w = QuantizedWeight([QuantizedTensor(FORMATS[name], raw, raw.shape[1] // FORMATS[name].block_bytes * BLOCK)
                         for name, raw in parts])
    w.use_native(lib)
    return w


def random_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32))


def engine_here(lib, name: str) -> str:
    """`name` where this library and OS run it, else the test is skipped naming why."""
    if name not in native_quant.panel_engines(lib):
        flags = this_cpu().flags
        if name == "avx2_int8":
            why = ("its library multiplies int8 with AVX512-VNNI instead" if "avx512_vnni" in flags
                   else "this CPU has no AVX2, FMA and F16C")
        elif name == "amx":
            why = "the OS refused AMX state" if {"amx_tile", "amx_bf16"} <= flags else "this CPU has no AMX (amx_bf16)"
        else:
            flag = name.removeprefix("avx512_")
            why = f"this CPU or its library has no AVX512-{flag.upper()} (avx512_{flag})"
        pytest.skip(f"no {name} products here: {why}")
    return name
