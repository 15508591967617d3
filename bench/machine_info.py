"""The machine a benchmark ran on, for its JSON: a number measured here is a claim about
this CPU only (AMX on one machine of a kind, AVX-512F alone on the next)."""

from __future__ import annotations

import os
import platform

import torch

from baton.engine.config import EngineConfig
from baton.engine.cpu_features import auto_cpu_dtype, this_cpu


def machine_record(threads: int | None = None) -> dict:
    cpu = this_cpu()
    dtype, why = auto_cpu_dtype(cpu)
    quantized, quantized_why = auto_cpu_dtype(cpu, quantized=True)  # the bundled GGUF's case
    kv, kv_why = EngineConfig().kv_dtype_choice(torch.device("cpu"), getattr(torch, quantized))
    return {"cpu": cpu.as_record(), "cores": os.cpu_count(), "threads": threads,
            "torch": torch.__version__, "python": platform.python_version(),
            "auto_dtype": dtype, "auto_dtype_reason": why,
            "auto_dtype_on_quantized_weights": quantized, "auto_dtype_on_quantized_weights_reason": quantized_why,
            "auto_kv_cache_dtype_on_quantized_weights": str(kv).removeprefix("torch."), "auto_kv_cache_reason": kv_why,
            "load_average_at_start": os.getloadavg()}  # other work skews every number
