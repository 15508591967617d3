#!/usr/bin/env bash
# GPU check for a CUDA machine: the Triton kernel tests compiled on the GPU (not the
# interpreter), the engine's agreement with HF transformers on the GPU (bench/gpu_agreement.py)
# and the engine bench, gathered into one JSON file (bench/results/gpu_check.json).
#
#   bash bench/gpu_check.sh                 # from anywhere; works in the repo root
#   TORCH_SPEC='torch==2.13.0 --index-url ...' bash bench/gpu_check.sh
#   GPU_CHECK_PHASES="kernels" bash bench/gpu_check.sh     # a subset: kernels agreement engine
#   ENGINE_RUNS=3 bash bench/gpu_check.sh                  # fewer timed rounds in the engine bench
#
# Python: .venv if it already has a CUDA torch and triton; else `make install` (TORCH_SPEC is
# passed through); else, offline, the machine's python3 with the repo on PYTHONPATH
# (GPU_CHECK_PYTHON=path forces one). Nothing else touches the network. OUT_JSON_DIR (default bench/results) also receives the engine
# bench JSON and a copy of gpu_check.json. Exit status: 0 only if every phase asked for passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

OUT_JSON_DIR=${OUT_JSON_DIR:-bench/results}
RESULT=bench/results/gpu_check.json
ENGINE_JSON="$OUT_JSON_DIR/engine_gpu.json"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p bench/results "$OUT_JSON_DIR"
rm -f "$ENGINE_JSON"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Fail fast instead of retrying for minutes where there is no network.
export PIP_DEFAULT_TIMEOUT=${PIP_DEFAULT_TIMEOUT:-10} PIP_RETRIES=${PIP_RETRIES:-0}

cuda_python() {
    "$1" -c 'import torch, triton; assert torch.cuda.is_available()' >/dev/null 2>&1
}

echo "== python"
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    PY=$GPU_CHECK_PYTHON SETUP="GPU_CHECK_PYTHON"
elif cuda_python .venv/bin/python; then
    PY=.venv/bin/python SETUP="reused .venv"
elif [ "${SKIP_INSTALL:-0}" != 1 ] && make install && cuda_python .venv/bin/python; then
    PY=.venv/bin/python SETUP="make install"
elif cuda_python python3; then
    PY=python3 SETUP="system python3 (no CUDA .venv and make install failed or was skipped)"
    export PYTHONPATH="$PWD/worker:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
else
    PY="" SETUP="no python with a CUDA torch and triton"
fi
echo "$SETUP${PY:+: $PY}"

echo "== nvidia-smi"
nvidia-smi 2>&1 | tee "$WORK/nvidia-smi.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    >"$WORK/gpu.csv" 2>/dev/null

PHASES=" ${GPU_CHECK_PHASES:-kernels agreement engine} "
# The native kernels' tests are CPU tests (make test runs them): only Triton's run here.
KERNEL_TESTS=${KERNEL_TESTS:-tests/kernels/test_triton_kernels.py tests/kernels/test_triton_quant_matmul.py}
AGREEMENT_JSON="$OUT_JSON_DIR/gpu_agreement.json"
rm -f "$AGREEMENT_JSON"
KERNELS_RC=-1 AGREEMENT_RC=-1 ENGINE_RC=-1 ENGINE_FLAG=""
if [ -n "$PY" ] && [[ $PHASES == *" kernels "* ]]; then
    echo "== kernel tests on cuda"
    # shellcheck disable=SC2086  # a list of test paths
    BATON_TRITON_DEVICE=cuda BATON_KERNEL_ERRORS_JSON="$WORK/kernel_errors.json" \
        "$PY" -m pytest $KERNEL_TESTS -q -rs -p no:cacheprovider \
        --junitxml="$WORK/kernels.xml" 2>&1 | tee "$WORK/kernels.log"
    KERNELS_RC=${PIPESTATUS[0]}
fi
if [ -n "$PY" ] && [[ $PHASES == *" agreement "* ]]; then
    echo "== engine against HF transformers on cuda"
    "$PY" bench/gpu_agreement.py --device cuda --out "$AGREEMENT_JSON" 2>&1 | tee "$WORK/agreement.log"
    AGREEMENT_RC=${PIPESTATUS[0]}
fi
if [ -n "$PY" ] && [[ $PHASES == *" engine "* ]]; then
    echo "== engine bench on cuda"
    if [ -f bench/engine.py ]; then
        # The bench names its output flag --out or --json-out; use whichever it has.
        ENGINE_FLAG=--out
        if ! "$PY" bench/engine.py --help 2>/dev/null | grep -q -- '--out\b' &&
            "$PY" bench/engine.py --help 2>/dev/null | grep -q -- '--json-out'; then
            ENGINE_FLAG=--json-out
        fi
        "$PY" bench/engine.py --device cuda --runs "${ENGINE_RUNS:-5}" "$ENGINE_FLAG" "$ENGINE_JSON" 2>&1 |
            tee "$WORK/engine.log"
        ENGINE_RC=${PIPESTATUS[0]}
    else
        echo "bench/engine.py not found" | tee "$WORK/engine.log"
    fi
fi

echo "== gathering $RESULT"
# Any python will do for the summary, even one without torch.
SUMMARY_PY=${PY:-python3}
"$SUMMARY_PY" - "$WORK" "$RESULT" "$ENGINE_JSON" "$SETUP" "$KERNELS_RC" "$ENGINE_RC" \
    "$ENGINE_FLAG" "$AGREEMENT_JSON" "$AGREEMENT_RC" "$PHASES" <<'EOF'
import json, os, sys, time
import xml.etree.ElementTree as ET

(work, result, engine_json, setup, kernels_rc, engine_rc, engine_flag, agreement_json, agreement_rc,
 phases) = sys.argv[1:]


def read(name, tail=4000):
    path = os.path.join(work, name)
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        return f.read()[-tail:]


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


tests = {"exit_code": int(kernels_rc)}
xml_path = os.path.join(work, "kernels.xml")
if os.path.exists(xml_path):
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    tests.update(counts, seconds=float(suite.get("time", 0)))
    tests["failed_tests"] = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
if int(kernels_rc) != 0:
    tests["log_tail"] = read("kernels.log")

agreement = {"exit_code": int(agreement_rc)}
if os.path.exists(agreement_json):
    agreement["results"] = load_json(agreement_json)
else:
    agreement["log_tail"] = read("agreement.log")

engine = {"exit_code": int(engine_rc), "output_flag": engine_flag or None}
if os.path.exists(engine_json):
    engine["results"] = load_json(engine_json)
else:
    engine["log_tail"] = read("engine.log")

versions = {}
try:
    import torch

    versions["torch"] = torch.__version__
    versions["cuda"] = torch.version.cuda
    import triton

    versions["triton"] = triton.__version__
except Exception as e:  # the summary must be written whatever is missing
    versions["error"] = repr(e)

gpu = (read("gpu.csv") or "").strip()
summary = {
    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "python_setup": setup,
    "gpu": gpu or None,
    "versions": versions,
    "phases": phases.split(),
    "kernel_tests": tests,
    "kernel_errors": load_json(os.path.join(work, "kernel_errors.json")),
    "agreement_with_hf": agreement,
    "engine_bench": engine,
    "nvidia_smi": read("nvidia-smi.txt"),
}
with open(result, "w") as f:
    json.dump(summary, f, indent=2)
print(json.dumps({k: summary[k] for k in ("python_setup", "gpu")}, indent=2))
print(json.dumps({k: v for k, v in tests.items() if k != "log_tail"}, indent=2))
EOF
if [ "$(realpath "$OUT_JSON_DIR")" != "$(realpath bench/results)" ]; then
    cp "$RESULT" "$OUT_JSON_DIR/"
fi
# 0 only if every phase asked for ran and passed
for rc in "$KERNELS_RC:kernels" "$AGREEMENT_RC:agreement" "$ENGINE_RC:engine"; do
    if [[ $PHASES == *" ${rc#*:} "* ]] && [ "${rc%%:*}" != 0 ]; then exit 1; fi
done
