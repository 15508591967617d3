"""Where a model's quantized matrices compute, chosen once after loading, and logged."""

from __future__ import annotations

import logging

import torch

from baton.engine.cpu_features import this_cpu
from baton.engine.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)

KERNELS = {  # quant_kernels.h's names
    "vnni512": "AVX512-VNNI integer dot products",
    "avx512": "AVX512BW integer dot products",
    "avx2": "AVX2 integer dot products",
    "scalar": "portable C (no AVX2 or AVX-512 found)",
}


def quantized_weights(model) -> list[QuantizedWeight]:
    seen: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            seen.setdefault(id(module), module)
    return list(seen.values())


def place_quantized(model, device: torch.device, setting: str) -> str:
    """Prepare the quantized matrices for `device`; return (and log) what runs them."""
    weights = quantized_weights(model)
    if not weights:
        why = "asked for none" if setting == "none" else "the checkpoint holds no quantized matrices"
        log.info("quantization %s: full-precision weights (%s)", setting, why)
        return "none"
    formats: dict[str, int] = {}
    for w in weights:
        formats[w.describe()] = formats.get(w.describe(), 0) + 1
    held = ", ".join(f"{count} x {name}" for name, count in sorted(formats.items()))
    megabytes = sum(w.nbytes for w in weights) / 2**20
    if device.type == "cuda":
        how = "Triton kernel, dequantizing inside the matmul"
    else:
        from baton.engine.native import build
        from baton.engine.native.quant import kernel_name

        lib = build.load()
        if lib is None:
            how = f"tiles dequantized with torch (slow: native library unavailable: {build.failure()})"
        else:
            for w in weights:
                w.use_native(lib)
            name = kernel_name(lib)
            how = f"native {name} kernels ({KERNELS.get(name, name)}) on {this_cpu().describe()}"
    log.info("quantization %s: the checkpoint's blocks as they are (%s; %.0f MB); products: %s",
             setting, held, megabytes, how)
    return how
