"""SwiGLU activation on a fused [gate | up] projection (twin of ref.silu_and_mul)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, sx, so, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * sx + inner + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # Round silu(gate) to the input dtype before the product, as torch does in two ops.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * so + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation on a fused [gate | up] projection: silu(gate) * up."""
    inner = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inner), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(1024, triton.next_power_of_2(inner))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inner, block))](
            x2, out, x2.stride(0), out.stride(0), inner, BLOCK=block,
        )
    return out.view(*x.shape[:-1], inner)
