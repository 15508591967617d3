#!/usr/bin/env bash
# llama.cpp (llama-cpp-python) for bench/engine.py, in a venv of its own: bench/.venv-llama-cpp.
# Built from source without GGML_NATIVE (a native build can crash on these machines); the
# AVX2/AVX-512 kernels are compiled in and ggml picks among them by what the CPU reports.
# Long on 2 cores (tens of minutes): run it with nice, never inside `make test`.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv-llama-cpp
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_FMA=ON -DGGML_F16C=ON}"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
"$VENV/bin/pip" install --no-binary llama-cpp-python --no-cache-dir --verbose "llama-cpp-python==$VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"
