"""Random quantized rows for the quantization tests: every quant value, sane scales."""

from __future__ import annotations

import numpy as np
import torch

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
