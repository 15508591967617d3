"""bf16 weights packed once for oneDNN's batch-reduce GEMM (decode_step.c: product_packed).

A decode step's products read every weight once for a handful of rows. MKL's bf16 product,
which takes the weights as they are, slows down past one row (22 ms for a SmolLM2 step's
products at 2-16 rows, against 12 ms at one); on weights packed ahead (AMX tiles where the
CPU has them) the same products take 12 ms from 1 to 16 rows. The packed copy costs as much
memory as the weights it copies, so it is made once per model and shared by every decoder
built for it (a reshard rebuilds the decoder, not this).
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
PACK_COLUMNS = 64  # as in decode_step.c


@dataclass(frozen=True)
class PackedWeights:
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # qkv, o, gate_up, down
    lm_head: torch.Tensor

    @property
    def nbytes(self) -> int:
        tensors = [t for layer in self.layers for t in layer] + [self.lm_head]
        return sum(t.nbytes for t in tensors)


_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> PackedWeights | None


def packed_weights(lib: ctypes.CDLL, model) -> PackedWeights | None:
    """The model's bf16 product weights packed for brgemm, or None when this torch or CPU
    has no packed bf16 product (then the native step uses MKL's), or BATON_NATIVE_PACKED=0."""
    if os.environ.get("BATON_NATIVE_PACKED", "1").strip() == "0":
        return None
    if model not in _made:
        _made[model] = _pack_model(lib, model)
    return _made[model]


def use_dot_products(lib: ctypes.CDLL) -> bool:
    """Without packed weights: the CPU's bf16 dot products (AVX512-BF16) rather than MKL's
    bf16 product, where the library was built for a CPU that has them (dot_bf16.h), unless
    BATON_NATIVE_DOT=0."""
    if not lib.baton_bf16_dot_available():
        log.info("bf16 decode products use MKL: this CPU has neither AMX nor AVX512-BF16")
        return False
    if os.environ.get("BATON_NATIVE_DOT", "1").strip() == "0":
        log.info("bf16 decode products use MKL (BATON_NATIVE_DOT=0)")
        return False
    log.info("bf16 decode products use the CPU's AVX512-BF16 dot products (no packed GEMM here)")
    return True


def _pack_model(lib: ctypes.CDLL, model) -> PackedWeights | None:
    if not lib.baton_bf16_packing_available():
        log.info("bf16 decode products: this torch or CPU has no packed bf16 GEMM")
        return None
    widest = max(w.shape[1] for layer in model.layers for w in _layer_weights(layer))
    scratch = torch.empty(widest * PACK_COLUMNS, dtype=torch.bfloat16)
    try:
        layers = [tuple(_pack(lib, w, scratch) for w in _layer_weights(layer)) for layer in model.layers]
        packed = PackedWeights(layers, _pack(lib, model.lm_head, scratch))
    except ValueError as why:
        log.info("bf16 decode products use MKL: %s", why)
        return None
    log.info("bf16 decode products use packed weights (%.0f MB more memory)", packed.nbytes / 2**20)
    return packed


def _layer_weights(layer) -> tuple[torch.Tensor, ...]:
    return layer.qkv, layer.o_proj, layer.gate_up, layer.down


def _pack(lib: ctypes.CDLL, weight: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(n * k, dtype=torch.bfloat16)
    if lib.baton_pack_bf16(ctypes.c_void_p(weight.data_ptr()), n, k, ctypes.c_void_p(out.data_ptr()),
                           ctypes.c_void_p(scratch.data_ptr())) != 0:
        raise ValueError(f"a weight of shape {tuple(weight.shape)} cannot be packed (odd inner size)")
    return out
