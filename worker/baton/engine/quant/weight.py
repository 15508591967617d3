"""A matrix held as a checkpoint's quantized blocks, and its products.

`QuantizedWeight` replaces a model's full-precision matrix. Its rows are one to three parts
(Q, K and V of a fused QKV may come in different formats), each a GGUF format's blocks as
the file stores them. How a product runs depends on where it runs:

- CPU with the native library: the blocks are rearranged once into the 16-row layout
  (quant/interleave.py). Products of few rows (decode) run on the int16 kernels
  (native/quant_*.h), which read each weight byte once. Products of many rows (a prompt's
  chunk) are compute-bound. Where the CPU multiplies bf16 (AMX tiles or AVX512-BF16) they
  run in bf16, each group of 16 weight rows dequantized once per product into cache
  (native/quant_bf16.h). Elsewhere tiles of the matrix are dequantized into a scratch
  buffer and multiplied by the CPU's dense GEMM in fp32. quant/placement.py
  picks the path and the row count. A row's result then depends on whether its step had
  enough rows for that path: decode batches below that count stay batch-invariant.
- CUDA: a Triton kernel dequantizes inside the matmul (kernels/triton/quant_matmul.py).
- CPU without the native library: TILE_ROWS weight rows at a time dequantized with torch
  ops into a scratch tile, multiplied in the model's dtype.

No path keeps a full-precision copy of the matrix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from baton.engine.quant.formats import BlockFormat
from baton.engine.quant.interleave import deinterleave, interleave
from baton.engine.quant.torch_blocks import dequantize_rows

log = logging.getLogger(__name__)
TILE_ROWS = 512  # weight rows dequantized at a time without the native library
DENSE_TILE_VALUES = 1 << 22  # weight values dequantized at a time for a dense prompt product


@dataclass(frozen=True)
class DenseProducts:
    """Products of at least `min_rows` input rows run as dequantized tiles times a dense
    GEMM in `dtype` (its sums in float32, its output rounded to `dtype`), or with `engine`
    (native/quant.py's PANEL_ENGINES), each group of weight rows unpacked inside the product
    (bf16 or int8 products, float32 sums and output). Products of `few_rows_from` rows up to
    `min_rows` run on `few_rows_engine` where it is set (int8 beside AMX tiles), the rest on
    the int16 kernels."""

    dtype: torch.dtype
    min_rows: int
    engine: str = ""
    few_rows_engine: str = ""
    few_rows_from: int = 0

    def route(self, rows: int) -> str | None:
        """Where a product of `rows` input rows runs: a panel engine's name, "" for the dense
        GEMM, None for the int16 kernels."""
        if rows >= self.min_rows:
            return self.engine
        if self.few_rows_engine and rows >= self.few_rows_from:
            return self.few_rows_engine
        return None


@dataclass
class QuantizedTensor:
    """A loader's quantized 2-D tensor: GGUF rows, unchanged."""

    fmt: BlockFormat
    raw: np.ndarray  # uint8 [rows, row_bytes]
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.k)


class QuantizedWeight(nn.Module):
    def __init__(self, parts: list[QuantizedTensor]):
        super().__init__()
        merged: list[QuantizedTensor] = []
        for part in parts:  # neighbours in one format become one part
            if merged and merged[-1].fmt == part.fmt:
                merged[-1] = QuantizedTensor(part.fmt, np.concatenate([merged[-1].raw, part.raw]), part.k)
            else:
                merged.append(part)
        if len({p.k for p in merged}) != 1:
            raise ValueError("the parts of a quantized matrix differ in width")
        self.k = merged[0].k
        self.formats = [p.fmt for p in merged]
        self.part_rows = [p.raw.shape[0] for p in merged]
        self.layout = "gguf"
        for i, part in enumerate(merged):
            self.register_buffer(f"part{i}", torch.from_numpy(np.array(part.raw, dtype=np.uint8, order="C")), persistent=False)
        self._lib = None
        self._matrix = None
        self.dense: DenseProducts | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(self.part_rows), self.k)

    @property
    def parts(self) -> list[torch.Tensor]:
        return [getattr(self, f"part{i}") for i in range(len(self.formats))]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.part0.device

    def data_ptr(self) -> int:
        return self.part0.data_ptr()

    def describe(self) -> str:
        return "+".join(f.name for f in self.formats)

    def checkpoint_rows(self, first: int, count: int) -> QuantizedTensor:
        """Rows first..first+count-1 as the checkpoint stored them (the rearranged layout
        undone): what a re-sliced tensor-parallel rank loads in place. They must lie in one
        part, as a fused matrix's Q, K, V or gate, up do."""
        start = 0
        for i, (fmt, rows) in enumerate(zip(self.formats, self.part_rows)):
            if start <= first and first + count <= start + rows:
                data = self.parts[i].cpu().numpy()
                if self.layout == "rows16":
                    data = deinterleave(fmt, data, rows, self.k)
                return QuantizedTensor(fmt, np.array(data[first - start : first - start + count]), self.k)
            start += rows
        raise IndexError(f"rows {first}..{first + count} do not lie in one part of {self.part_rows}")

    # -- CPU layout ------------------------------------------------------------------------
    def use_native(self, lib, dense: DenseProducts | None = None) -> None:
        """Rearrange the blocks for the native kernels (once; the GGUF rows are dropped);
        products of `dense.min_rows` rows or more then run as dequantized tiles."""
        if self.layout == "gguf":
            for i, fmt in enumerate(self.formats):
                data = interleave(fmt, self.parts[i].numpy())
                setattr(self, f"part{i}", torch.from_numpy(data))
            self.layout = "rows16"
        self._lib = lib
        self.dense = dense
        self._matrix = self._native_view()

    def _native_view(self):
        """The ctypes QuantMatrix over the parts as they are now (they must outlive it)."""
        from baton.engine.native import quant as native_quant

        return native_quant.matrix(
            self.k, [(t, f.ggml_type, r) for t, f, r in zip(self.parts, self.formats, self.part_rows)])

    def replace_parts(self, tensors: list[torch.Tensor]) -> None:
        """Hold `tensors` (copies of the parts, same shapes and dtypes) as the parts, the
        native matrix pointing at them."""
        if [(t.shape, t.dtype) for t in tensors] != [(p.shape, p.dtype) for p in self.parts]:
            raise ValueError("replacement parts must match the parts' shapes and dtypes")
        for i, tensor in enumerate(tensors):
            setattr(self, f"part{i}", tensor)
        if self._matrix is not None:
            self._matrix = self._native_view()

    @property
    def native_matrix(self):
        """The ctypes QuantMatrix of the interleaved blocks (None before `use_native`)."""
        return self._matrix

    # -- products ----------------------------------------------------------------------------
    def dequantize(self, first: int, count: int) -> torch.Tensor:
        """Rows first..first+count-1 in float32 (a tile, never the whole of a large matrix)."""
        if not (0 <= first and first + count <= self.shape[0]):
            raise IndexError(f"rows {first}..{first + count} outside a matrix of {self.shape[0]}")
        if self.layout == "rows16":
            from baton.engine.native import quant as native_quant

            return native_quant.dequantize(self._lib, self._matrix, first, count)
        tiles, start = [], 0
        for fmt, rows, data in zip(self.formats, self.part_rows, self.parts):
            lo, hi = max(first, start), min(first + count, start + rows)
            if lo < hi:
                tiles.append(dequantize_rows(fmt, data[lo - start : hi - start]))
            start += rows
        return torch.cat(tiles) if len(tiles) > 1 else tiles[0]

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows `ids` (a lookup table's), in `dtype`."""
        if self.layout == "gguf" and len(self.formats) == 1:  # one gather on any device
            rows = dequantize_rows(self.formats[0], self.part0[ids.reshape(-1).to(self.device)])
            return rows.to(dtype).reshape(*ids.shape, self.k)
        flat = ids.reshape(-1).tolist()
        out = torch.empty(len(flat), self.k, dtype=torch.float32, device=self.device)
        for i, row in enumerate(flat):
            out[i] = self.dequantize(row, 1)[0]
        return out.to(dtype).reshape(*ids.shape, self.k)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias), in x's dtype: float32 sums, the bias added before the one
        rounding to x's dtype (as the native decode step does)."""
        if x.device.type == "cuda":
            from baton.engine.kernels.triton.quant_matmul import quant_matmul

            out = quant_matmul(x, self)
        elif self._matrix is not None and self.dense is not None and (route := self.dense.route(x.shape[0])) is not None:
            out = self._panel_linear(x, route) if route else self._dense_linear(x)
        elif self._matrix is not None:
            from baton.engine.native import quant as native_quant

            out = native_quant.product(self._lib, self._matrix, x, self.shape[0])
        else:
            out = self._tiled_linear(x.float())
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)

    def _tiled_linear(self, x: torch.Tensor) -> torch.Tensor:
        n = self.shape[0]
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for first in range(0, n, TILE_ROWS):
            count = min(TILE_ROWS, n - first)
            out[:, first : first + count] = x @ self.dequantize(first, count).to(x.dtype).t()
        return out

    def _panel_linear(self, x: torch.Tensor, engine: str) -> torch.Tensor:
        from baton.engine.native import quant as native_quant

        return native_quant.product_panels(self._lib, self._matrix, x, self.shape[0], engine)

    def _dense_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T in float32 through the dense GEMM, a few million weight values at a time
        dequantized, straight into the GEMM's dtype, into one reused scratch tile."""
        from baton.engine.native import quant as native_quant

        n, dtype = self.shape[0], self.dense.dtype
        step = max(1, min(n, DENSE_TILE_VALUES // self.k))
        scratch = torch.empty(step, self.k, dtype=dtype)  # float32 or bfloat16 (DenseProducts)
        xs = x.to(dtype)
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        for first in range(0, n, step):
            count = min(step, n - first)
            tile = native_quant.dequantize(self._lib, self._matrix, first, count, out=scratch[:count])
            out[:, first : first + count] = xs @ tile.t()
        return out


def describe_model(model) -> dict[str, int]:
    """{format names: matrices} over a model's quantized matrices."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            counts[module.describe()] = counts.get(module.describe(), 0) + 1
    return counts

