"""The machine a benchmark ran on, for its JSON: a number measured here is a claim about
this CPU only (AMX on one machine of a kind, AVX-512F alone on the next)."""

from __future__ import annotations

import os
import platform

import torch

from baton.engine.cpu_features import auto_cpu_dtype, this_cpu


def machine_record(threads: int | None = None) -> dict:
    cpu = this_cpu()
    dtype, why = auto_cpu_dtype(cpu)
    return {"cpu": cpu.as_record(), "cores": os.cpu_count(), "threads": threads,
            "torch": torch.__version__, "python": platform.python_version(),
            "auto_dtype": dtype, "auto_dtype_reason": why,
            "load_average_at_start": os.getloadavg()}  # other work skews every number
