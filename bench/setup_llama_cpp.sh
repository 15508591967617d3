#!/usr/bin/env bash
# llama.cpp (llama-cpp-python) for bench/engine.py, in a venv of its own: bench/.venv-llama-cpp.
# Built from source without GGML_NATIVE (a native build can crash on these machines), with
# the instruction sets this CPU reports turned on one by one (AVX2, FMA, F16C, AVX-512 and
# its VNNI/BF16/VBMI extensions where present): llama.cpp at its best on the CPU it runs on,
# and no AVX-512 code on a CPU without it. Set CMAKE_ARGS to override.
# Long on 2 cores (tens of minutes): run it with nice, never inside `make test`.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv-llama-cpp
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }
args="-DGGML_NATIVE=OFF"
for pair in avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 \
            avx512vbmi:AVX512_VBMI avx_vnni:AVX_VNNI; do
    if has "${pair%%:*}"; then args="$args -DGGML_${pair##*:}=ON"; else args="$args -DGGML_${pair##*:}=OFF"; fi
done
export CMAKE_ARGS="${CMAKE_ARGS:-$args}"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
stamp="$VENV/.built-with"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$VERSION $CMAKE_ARGS" ]]; then
    echo "building llama-cpp-python $VERSION with CMAKE_ARGS=$CMAKE_ARGS"
    "$VENV/bin/pip" uninstall --yes llama-cpp-python >/dev/null 2>&1 || true
    "$VENV/bin/pip" install --no-binary llama-cpp-python --no-cache-dir --verbose "llama-cpp-python==$VERSION"
    echo "$VERSION $CMAKE_ARGS" > "$stamp"
fi
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"
