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
# their tests that no kernel decides: inputs refused before the native call, the library
# left out or switched off, a pool rebound; and the build from an empty cache (a compile of
# its own, the same on every level)
LEVEL_BLIND = ("builds_from_source", "refused_before_the_native_call", "without_the_library",
               "disabled_by_environment", "reshard_rebinds")
LEVEL_BLIND_DESELECTED = " and ".join(f"not {name}" for name in LEVEL_BLIND)  # pytest's -k


LEVELS = ("x86-64-v3", "x86-64-v4")


def _kernels(lib) -> tuple[str, tuple[str, ...]]:
    return native_quant.kernel_name(lib), tuple(native_quant.panel_engines(lib))


@pytest.fixture(scope="module")
def level_runs(lib, tmp_path_factory, request):
    """Each level's suites in a process of its own, all started at once (on 2 cores, ~85 s
    together, the tests no kernel decides left out): level -> (its library, the process, its
    output file), or the reason it is skipped."""
    runs = {}
    chosen = {item.callspec.params["level"] for item in request.session.items
              if item.originalname == "test_the_native_suites_pass_on_a_library_built_for_an_older_level"}
    for level in sorted(chosen):
        if missing := build.missing_for(level):
            runs[level] = f"this CPU lacks {', '.join(missing)} for -march={level}"
            continue
        portable = build.library_for(level)  # compiled here, before the suites load it
        if _kernels(portable) == _kernels(lib):
            runs[level] = f"this CPU's own build holds {level}'s kernels ({_kernels(lib)}): the suites ran on them"
            continue
        output = tmp_path_factory.mktemp(level) / "pytest.txt"
        # threads that wait sleep: two processes' spinning OpenMP threads on two cores
        env = {**os.environ, build.MARCH_ENV: level, "OMP_WAIT_POLICY": "PASSIVE"}
        with output.open("w") as sink:
            process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                                        "not heavy", "-k", LEVEL_BLIND_DESELECTED, *SUITES],
                                       cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        runs[level] = (portable, process, output)
    yield runs
    for run in runs.values():
        if not isinstance(run, str) and run[1].poll() is None:
            run[1].kill()
            run[1].wait()


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_the_native_suites_pass_on_a_library_built_for_an_older_level(level_runs, level):
    run = level_runs[level]
    if isinstance(run, str):
        pytest.skip(run)
    portable, process, output = run
    try:
        returncode = process.wait(timeout=SUITE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"the suites built for {level} did not end within {SUITE_TIMEOUT_S} s:\n"
                    + output.read_text()[-4000:])
    printed = output.read_text()
    assert returncode == 0, printed[-8000:]
    # it ran them on that build: the int8 engine AVX2's (both levels hold it), each test run
    passed = re.search(r"(\d+) passed", printed)
    assert passed and int(passed.group(1)) >= 150, printed[-2000:]
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
