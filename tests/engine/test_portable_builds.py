"""The kernels an older CPU runs, tested on this one. The native library is built for the CPU
it runs on, so a CPU with AVX-512 never ran AVX2's kernels (a Zen 3's: int8 products on
VPMADDUBSW, the prompt attention's portable lanes, SwiGLU's exp) and one with VNNI never ran
the int16 kernels on AVX-512 beside AVX2's int8 products (a Skylake-X's). BATON_NATIVE_MARCH
builds the library for an x86-64 level instead; here the native-step and kernel suites run
again in a process built for each level this CPU runs whose kernels differ from its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from baton.engine.cpu_features import CpuInfo
from baton.engine.native import build
from baton.engine.native import quant as native_quant

ROOT = Path(__file__).resolve().parents[2]
# the suites whose tests call the native library's kernels, steps and product engines
SUITES = ["tests/engine/test_native_decode.py", "tests/engine/test_native_prompt_steps.py",
          "tests/engine/test_quant_int8.py", "tests/engine/test_quantized_engine.py",
          "tests/kernels/test_native_decode_attention.py", "tests/kernels/test_native_prompt_attention.py",
          "tests/kernels/test_native_rope.py", "tests/kernels/test_native_swiglu.py"]
SUITE_TIMEOUT_S = 600


def _kernels(lib) -> tuple[str, tuple[str, ...]]:
    return native_quant.kernel_name(lib), tuple(native_quant.panel_engines(lib))


@pytest.mark.slow
@pytest.mark.parametrize("level", ["x86-64-v3", "x86-64-v4"])
def test_the_native_suites_pass_on_a_library_built_for_an_older_level(lib, level):
    if missing := build.missing_for(level):
        pytest.skip(f"this CPU lacks {', '.join(missing)} for -march={level}")
    portable = build.library_for(level)
    if _kernels(portable) == _kernels(lib):
        pytest.skip(f"this CPU's own build holds {level}'s kernels ({_kernels(lib)}): the suites ran on them")
    env = {**os.environ, build.MARCH_ENV: level}
    # (less the build from an empty cache: a compile of its own, the same on every level)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not heavy",
                           "-k", "not builds_from_source", *SUITES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    # it ran them on that build: the int8 engine AVX2's (both levels hold it), each test run
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 150, done.stdout[-2000:]
    assert "avx2_int8" in _kernels(portable)[1]


def test_the_level_is_native_unless_the_environment_names_another(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")  # (every x86-64 CPU runs the base level)
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    assert build.chosen_level() == "native" and build.describe() == "built for this CPU"
    assert build.level_flags("native") == build.FLAGS
    monkeypatch.setenv(build.MARCH_ENV, " x86-64 ")
    assert build.chosen_level() == "x86-64" and build.describe() == f"built for x86-64 ({build.MARCH_ENV})"
    assert "-march=x86-64" in build.level_flags("x86-64") and "-march=native" not in build.level_flags("x86-64")


@pytest.mark.parametrize("value", ["haswell", "x86-64-v5", "-O0", "native x86-64"])
def test_a_name_that_is_no_level_is_refused_naming_the_levels(monkeypatch, value):
    monkeypatch.setenv(build.MARCH_ENV, value)
    with pytest.raises(ValueError, match=rf"{build.MARCH_ENV} is native or one of x86-64, x86-64-v2, x86-64-v3, "
                                         rf"x86-64-v4, not '{re.escape(value)}'"):
        build.load()


def test_a_level_this_cpu_cannot_run_is_refused_naming_the_flags_it_lacks(monkeypatch):
    """Code for a level the CPU lacks would die of SIGILL at its first step: the engine
    refuses to start instead (its load raises; nothing falls back to another build)."""
    avx2_only = CpuInfo("an AVX2 CPU", "x86_64", frozenset(build.LEVEL_FLAGS["x86-64-v3"]))
    monkeypatch.setattr(build, "this_cpu", lambda: avx2_only)
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v4")
    with pytest.raises(ValueError, match=f"{build.MARCH_ENV}=x86-64-v4: this CPU cannot run that code, it lacks "
                                         "avx512f, avx512bw, avx512cd, avx512dq, avx512vl"):
        build.load()
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v3")
    assert build.missing_for("x86-64-v3") == [] and build.chosen_level() == "x86-64-v3"
