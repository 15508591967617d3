"""Linear layers on CPU: bf16 weights prepacked for oneDNN.

PyTorch's plain bf16 matmul reads an unpacked weight and, at the small row counts of
decode steps, runs at a fraction of memory bandwidth. oneDNN with a weight reordered once
at load time is 1.5-2x faster there and bit-identical. fp32 keeps F.linear: MKL's
matrix-vector path already beats oneDNN for one-row decodes, and its whole-matrix sgemm
beat the same product cut into 512-row slabs here (prefill of 1,024 tokens: 1,005-1,013
vs 944-953 tokens/s, alternating in one process).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[[torch.Tensor], torch.Tensor]


def _onednn_bf16_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearFn:
    """A function computing x @ weight.T + bias as fast as this device allows (weight may be
    a quant.weight.QuantizedWeight: its blocks' own products)."""
    from baton.engine.quant.weight import QuantizedWeight

    if isinstance(weight, QuantizedWeight):
        return lambda x: weight.linear(x, bias)
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _onednn_bf16_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        except RuntimeError:
            packed = None
        if packed is not None:
            op = torch.ops.mkldnn._linear_pointwise

            def onednn_linear(x: torch.Tensor) -> torch.Tensor:
                return op(x, packed, bias, "none", [], "")

            return onednn_linear
    return lambda x: F.linear(x, weight, bias)

