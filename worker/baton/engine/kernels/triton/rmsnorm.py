"""RMSNorm and fused residual add + RMSNorm (twins of ref.rms_norm / ref.fused_add_rms_norm).

The math is fp32; the normalised row is rounded to the input dtype before the weight
multiply, exactly as the reference (and HF Llama) does, so bf16 results match bit for bit
up to the order of the sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    sx, sr, sres_out, so,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the residual's dtype first: the norm sees what is stored.
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * sres_out + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / hidden
    normed = x * tl.rsqrt(var + eps)
    if HAS_RESIDUAL:
        normed = normed.to(res_out_ptr.dtype.element_ty)
    else:
        normed = normed.to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * so + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] as [rows, H] with unit stride along H (copies only when it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    x2 = _rows(x)
    weight = weight.contiguous()
    if residual is None:
        res2 = res_out = x2  # unused: HAS_RESIDUAL is off
        norm_dtype = x.dtype
    else:
        res2 = _rows(residual)
        norm_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(x2.shape, dtype=norm_dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.promote_types(norm_dtype, weight.dtype),
                      device=x.device)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out,
            x2.stride(0), res2.stride(0), res_out.stride(0), out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
            num_warps=4 if hidden <= 4096 else 8,
        )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, returned in x's dtype (as HF Llama does)."""
    out, _ = _launch(x, None, weight, eps)
    return out.view(*x.shape[:-1], out.shape[-1])


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; return (rms_norm(residual), residual).

    Like the reference, the inputs are left untouched and the new residual is a new tensor.
    """
    assert x.shape == residual.shape, "x and residual must have the same shape"
    out, res_out = _launch(x, residual, weight, eps)
    shape = x.shape
    return out.view(shape), res_out.view(shape)
