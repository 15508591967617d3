"""Compile and load the native CPU decode step (decode_step.c) once per machine.

The library is built with the system C compiler into a cache folder keyed by the source,
the flags, the torch build and the CPU, and links to torch's own libtorch_cpu for its BLAS
(so its products are the ones torch computes). Anything missing (no compiler, a torch
without MKL's sgemm_) makes `load()` return None with the reason, and the engine keeps its
torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_step.c")
# every header beside the source is part of what the library is built from (and named by)
HEADERS = tuple(sorted(SOURCE.parent.glob("*.h")))
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
BUILD_TIMEOUT_S = 120
# (activations' dtype, KV cache's dtype) -> the step compiled for the pair
ENTRY_POINTS = {(torch.float32, torch.float32): "baton_decode_step_f32",
                (torch.float32, torch.bfloat16): "baton_decode_step_f32_kvbf16",
                (torch.bfloat16, torch.bfloat16): "baton_decode_step_bf16"}
TORCH_LIB = Path(torch.__file__).parent / "lib"  # libtorch_cpu, with the MKL torch uses


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "baton" / "native"


def library_name(source: bytes, flags: list[str], torch_version: str, cpu: str) -> str:
    """A file name that changes whenever what the library is built from or for changes
    (-march=native code must not run on another CPU sharing the home folder)."""
    key = b"\0".join((source, " ".join(flags).encode(), torch_version.encode(), cpu.encode()))
    return f"decode_step-{hashlib.sha256(key).hexdigest()[:16]}.so"


def cpu_identity() -> str:
    """The CPU's model and feature flags, as far as this system tells them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _compile(target: Path, flags: list[str]) -> None:
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")]
    if compiler[0] is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: a concurrent builder never sees half a file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        cmd = [*compiler, *flags, str(SOURCE), "-o", str(partial),
               f"-L{TORCH_LIB}", "-ltorch_cpu", f"-Wl,-rpath,{TORCH_LIB}", "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(partial, target)


def build_library(folder: Path, flags: list[str] | None = None) -> Path:
    """The library for this source, flags, torch and CPU in `folder`, compiled if missing.
    `flags` replaces FLAGS (tests build the portable kernels with another -march)."""
    flags = FLAGS if flags is None else flags
    source = b"".join(path.read_bytes() for path in (SOURCE, *HEADERS))
    target = folder / library_name(source, flags, torch.__version__, cpu_identity())
    if not target.exists():
        _compile(target, flags)
    return target


def open_library(path: Path) -> ctypes.CDLL:
    # its libtorch_cpu dependency is the one this process loaded with torch (same soname)
    lib = ctypes.CDLL(str(path))
    for name in ENTRY_POINTS.values():
        getattr(lib, name).restype = ctypes.c_int
    lib.baton_quant_kernel.restype = ctypes.c_char_p
    lib.baton_quant_dequantize_kernel.restype = ctypes.c_char_p
    lib.baton_quant_input_bytes.restype = ctypes.c_int64
    lib.baton_quant_input_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.baton_prompt_attention.restype = ctypes.c_int
    lib.baton_prompt_attention.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.baton_decode_attention.restype = ctypes.c_int
    lib.baton_decode_attention.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    lib.baton_rope_f32.restype = ctypes.c_int
    lib.baton_rope_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.baton_silu_and_mul_f32.restype = None
    lib.baton_silu_and_mul_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.baton_quant_panel_scratch_bytes.restype = ctypes.c_int64
    lib.baton_quant_panel_scratch_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    for name in ("baton_quant_product", "baton_quant_quantize_input", "baton_quant_dequantize_to"):
        getattr(lib, name).restype = None
    return lib


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    try:
        return open_library(build_library(cache_dir())), None
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, str(exc)


def load() -> ctypes.CDLL | None:
    """The compiled library, or None when it cannot be built or loaded (see `failure()`)."""
    return _load()[0]


def failure() -> str | None:
    """Why `load()` returned None, if it did."""
    return _load()[1]
