"""ctypes view of quantized matrices for the native library (quant_product.h)."""

from __future__ import annotations

import ctypes

import torch

from baton.engine.native import build


class QuantPart(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("format", ctypes.c_int), ("rows", ctypes.c_int)]


MAX_PARTS = 3  # QUANT_MAX_PARTS


class QuantMatrix(ctypes.Structure):
    _fields_ = [("k", ctypes.c_int), ("count", ctypes.c_int), ("parts", QuantPart * MAX_PARTS)]


def kernel_name(lib: ctypes.CDLL) -> str:
    """Which integer dot products the library was compiled to use on this CPU."""
    return lib.baton_quant_kernel().decode()


def dequantize_kernel_name(lib: ctypes.CDLL) -> str:
    """Which instructions the library dequantizes tiles with on this CPU."""
    return lib.baton_quant_dequantize_kernel().decode()


def matrix(k: int, parts: list[tuple[torch.Tensor, int, int]]) -> QuantMatrix:
    """A QuantMatrix over (interleaved data, ggml type id, rows) parts; the tensors must
    outlive it."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"a quantized matrix has 1 to {MAX_PARTS} parts, not {len(parts)}")
    m = QuantMatrix(k=k, count=len(parts))
    for i, (data, ggml_type, rows) in enumerate(parts):
        m.parts[i] = QuantPart(data.data_ptr(), ggml_type, rows)
    return m


def product(lib: ctypes.CDLL, m: QuantMatrix, x: torch.Tensor, n: int) -> torch.Tensor:
    """float32 x [rows, k] @ W^T -> float32 [rows, n], x quantized to int16 per block."""
    x = x.to(torch.float32).contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    if rows:
        scratch = torch.empty(lib.baton_quant_input_bytes(rows, m.k), dtype=torch.uint8)
        lib.baton_quant_product(ctypes.byref(m), ctypes.c_void_p(x.data_ptr()), ctypes.c_int(rows),
                                ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(scratch.data_ptr()))
    return out


# The engines of the many-row products, each unpacking a group of weight rows once into a
# panel in cache (quant_bf16.h: bf16 products; quant_int8.h: int8 products, on AVX512-VNNI or
# else on AVX2, quant_int8_avx2.h): bit number and name, in the order `panel_engines` ranks
# them, slowest first. A library holds at most one of the two int8 engines.
PANEL_ENGINES = {4: "avx2_int8", 1: "avx512_bf16", 3: "avx512_vnni", 2: "amx"}
PANEL_ENGINE_IDS = {name: bit for bit, name in PANEL_ENGINES.items()}


def panel_engines(lib: ctypes.CDLL) -> list[str]:
    """The engines that can run many-row products on quantized weights here, fastest last
    (the instructions compiled in, and for AMX the OS's leave): AVX512-VNNI's int8 products
    ran SmolLM2's 1.35-1.45x faster than AVX512-BF16's on a Zen 4 core from 16 rows to 512
    (bench/quant_products.py); AMX tiles take far more products an instruction than either.
    Which of them serve is quant/placement.py's choice."""
    mask = lib.baton_quant_panel_engines()
    return [name for bit, name in PANEL_ENGINES.items() if mask & 1 << bit]


def product_panels(lib: ctypes.CDLL, m: QuantMatrix, x: torch.Tensor, n: int, engine: str = "") -> torch.Tensor:
    """float32 x [rows, k] @ W^T -> float32 [rows, n]: each group of weight rows unpacked
    once into a panel in cache, on `engine`: bf16 products (quant_bf16.h; the default: AMX
    where allowed, else AVX512-BF16) or int8 ones (`avx512_vnni` or `avx2_int8`, quant_int8.h)."""
    if engine and engine not in PANEL_ENGINE_IDS:
        raise ValueError(f"unknown panel engine {engine!r}: one of {sorted(PANEL_ENGINE_IDS)}")
    x = x.to(torch.float32).contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    if rows:
        scratch = torch.empty(lib.baton_quant_panel_scratch_bytes(rows, m.k), dtype=torch.uint8)
        status = lib.baton_quant_product_panels(
            ctypes.byref(m), ctypes.c_void_p(x.data_ptr()), ctypes.c_int(rows), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_void_p(scratch.data_ptr()), ctypes.c_int(PANEL_ENGINE_IDS.get(engine, 0)))
        if status != 0:
            raise RuntimeError(f"panel product failed: {engine or 'every bf16 engine'} unavailable here"
                               if status == -1 else "panel product failed: out of memory")
    return out


def dequantize(lib: ctypes.CDLL, m: QuantMatrix, first: int, count: int, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows first..first+count-1 of W [count, k] in float32 or bfloat16 (`out`'s dtype if
    given; contiguous)."""
    if out is None:
        out = torch.empty(count, m.k, dtype=dtype)
    if out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous() or tuple(out.shape) != (count, m.k):
        raise ValueError(f"dequantize writes a contiguous float32 or bfloat16 [{count}, {m.k}] tensor, "
                         f"not {out.dtype} {tuple(out.shape)}")
    lib.baton_quant_dequantize_to(ctypes.byref(m), ctypes.c_int(first), ctypes.c_int(count),
                                  ctypes.c_void_p(out.data_ptr()), ctypes.c_int(out.dtype == torch.bfloat16))
    return out


def quantize_input(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int16 [rows, k], d float32 [rows, nb], sums int32 [rows, nb]) as the kernels make
    them (q back in the inputs' order: the kernels store each 4 as q0 q2 q1 q3)."""
    x = x.to(torch.float32).contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int16)
    d = torch.empty(rows, k // 32, dtype=torch.float32)
    sums = torch.empty(rows, k // 32, dtype=torch.int32)
    lib.baton_quant_quantize_input(*(ctypes.c_void_p(t.data_ptr()) for t in (x,)), ctypes.c_int(rows), ctypes.c_int(k),
                                   *(ctypes.c_void_p(t.data_ptr()) for t in (q, d, sums)))
    return q.reshape(rows, k // 4, 4)[..., [0, 2, 1, 3]].reshape(rows, k), d, sums


def library() -> ctypes.CDLL | None:
    return build.load()
