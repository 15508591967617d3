"""Compile and load the native CPU decode step (decode_step.c) once per machine.

The library is built with the system C compiler into a cache folder keyed by the source,
the flags, the torch build and the CPU, and links to torch's own libtorch_cpu for its BLAS
(so its products are the ones torch computes). Anything missing (no compiler, a torch
without MKL's sgemm_) makes `load()` return None with the reason, and the engine keeps its
torch path.

It is built for this CPU (-march=native) unless BATON_NATIVE_MARCH names one of the x86-64
levels (x86-64, x86-64-v2, x86-64-v3: AVX2, x86-64-v4: AVX-512 without VNNI or BF16): the
kernels an older CPU runs, on this one (a native build that misbehaves on an unusual CPU or
VM, a path to compare; the tests run the AVX2 and AVX-512F kernels so on CPUs that have more).
A level this CPU cannot run is refused, naming the flags it lacks.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from baton.engine.cpu_features import this_cpu

SOURCE = Path(__file__).with_name("decode_step.c")
# every header beside the source is part of what the library is built from (and named by)
HEADERS = tuple(sorted(SOURCE.parent.glob("*.h")))
# A value of the wrong type where a pointer goes (an int shadowing a struct pointer once
# compiled with a warning and crashed at its first step) stops the build instead: the engine
# then says why and keeps the torch path.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-Werror=int-conversion",
         "-Werror=incompatible-pointer-types", "-Werror=implicit-function-declaration"]
BUILD_TIMEOUT_S = 120
# (activations' dtype, KV cache's dtype) -> the step compiled for the pair
ENTRY_POINTS = {(torch.float32, torch.float32): "baton_decode_step_f32",
                (torch.float32, torch.bfloat16): "baton_decode_step_f32_kvbf16",
                (torch.bfloat16, torch.bfloat16): "baton_decode_step_bf16"}
TORCH_LIB = Path(torch.__file__).parent / "lib"  # libtorch_cpu, with the MKL torch uses
MARCH_ENV = "BATON_NATIVE_MARCH"
# the x86-64 levels a build may target instead of this CPU, and the CPU flags each needs
LEVEL_FLAGS = {
    "x86-64": (),
    "x86-64-v2": ("ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm"),
    "x86-64-v3": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"),
    "x86-64-v4": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "avx512f", "avx512bw", "avx512cd",
                  "avx512dq", "avx512vl"),
}


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
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def level_flags(level: str) -> list[str]:
    """FLAGS for the x86-64 `level` instead of this CPU ("native": FLAGS themselves)."""
    if level == "native":
        return list(FLAGS)
    if level not in LEVEL_FLAGS:
        raise ValueError(f"{MARCH_ENV} is native or one of {', '.join(LEVEL_FLAGS)}, not {level!r}")
    return [f"-march={level}" if flag == "-march=native" else flag for flag in FLAGS]


def missing_for(level: str) -> list[str]:
    """The CPU flags this CPU lacks to run code built for `level` (x86 only)."""
    if platform.machine() != "x86_64":
        return [f"an x86-64 CPU (this is {platform.machine()})"]
    have = this_cpu().flags
    return [flag for flag in LEVEL_FLAGS[level] if flag not in have]


def chosen_level() -> str:
    """What the library is built for: BATON_NATIVE_MARCH's level, else native. A level
    this CPU cannot run, or a name that is none, is refused (ValueError): a worker told to
    run older kernels must not quietly run others, or torch's."""
    level = os.environ.get(MARCH_ENV, "").strip() or "native"
    level_flags(level)
    if level != "native" and (missing := missing_for(level)):
        raise ValueError(f"{MARCH_ENV}={level}: this CPU cannot run that code, it lacks {', '.join(missing)}")
    return level


def describe() -> str:
    """The build the engine runs, for its log."""
    level = chosen_level()
    return "built for this CPU" if level == "native" else f"built for {level} ({MARCH_ENV})"


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
    lib.baton_prompt_attention_paged.restype = ctypes.c_int
    lib.baton_prompt_attention_paged.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                 ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                                 ctypes.c_void_p, ctypes.c_int]
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


def library_for(level: str) -> ctypes.CDLL:
    """The library built for the x86-64 `level` ("native": this CPU), compiled if missing,
    whatever BATON_NATIVE_MARCH says (the tests compare the levels' kernels on one CPU)."""
    return open_library(build_library(cache_dir(), level_flags(level)))


@functools.cache
def _load(level: str) -> tuple[ctypes.CDLL | None, str | None]:
    try:
        return library_for(level), None
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, str(exc)


def load() -> ctypes.CDLL | None:
    """The compiled library (for `chosen_level()`), or None when it cannot be built or
    loaded (see `failure()`)."""
    return _load(chosen_level())[0]


def failure() -> str | None:
    """Why `load()` returned None, if it did."""
    return _load(chosen_level())[1]
