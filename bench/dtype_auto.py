"""Is `--dtype auto` the fastest dtype on this CPU? Batch-1 decode and a 1,024-token prefill
in bf16 and fp32, two engines in one process taking turns (so drift hits both alike),
median of `--runs`; auto's choice against the faster of the two (target: within 5%).

    .venv/bin/python bench/dtype_auto.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
from machine_info import machine_record

from baton.engine.cpu_features import auto_cpu_dtype, this_cpu

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DTYPES = ("bfloat16", "float32")
TARGET = 0.95  # auto's speed over the best explicit dtype's


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    from baton.engine import Engine, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--out", default="bench/results/dtype_auto.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_record(args.threads)
    engines = {name: Engine(dtype=name, chunk_size=0, max_num_batched_tokens=4096, kv_cache_memory_gb=0.5)
               for name in DTYPES}
    rng = random.Random(0)
    short = engines["float32"].tokenizer.encode("The history of the printing press begins")
    n, t = args.decode_tokens, args.prefill_tokens

    def decode(engine):  # a fresh first token each time: the prefix cache shortcuts nothing
        engine.generate([[rng.randrange(1000, 40000), *short]], SamplingParams(max_tokens=n, ignore_eos=True))

    def prefill(engine):
        engine.generate([[rng.randrange(1000, 40000) for _ in range(t)]], SamplingParams(max_tokens=1))

    for engine in engines.values():
        decode(engine), prefill(engine)  # warm-up: native library, caches, allocator
    samples = {f"{kind}_{name}": [] for kind in ("decode_b1", "prefill") for name in DTYPES}
    for _ in range(args.runs):
        for name, engine in engines.items():
            samples[f"decode_b1_{name}"].append(n / seconds(lambda e=engine: decode(e)))
            samples[f"prefill_{name}"].append(t / seconds(lambda e=engine: prefill(e)))
    tokens_per_s = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    # what `--dtype auto` runs in the engine itself: on quantized weights (the default) that is
    # not always the CPU's full-precision choice
    quantized = engines["float32"].runner.quantization != "none"
    auto, why = auto_cpu_dtype(this_cpu(), quantized)
    auto_vs_best = {kind: round(tokens_per_s[f"{kind}_{auto}"] / max(tokens_per_s[f"{kind}_{d}"] for d in DTYPES), 3)
                    for kind in ("decode_b1", "prefill")}
    result = {
        "bench": "dtype_auto", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine, "settings": vars(args), "auto": auto, "auto_reason": why,
        "tokens_per_s": tokens_per_s, "samples": {k: [round(x, 2) for x in v] for k, v in samples.items()},
        "auto_vs_best": auto_vs_best, "target": TARGET,
        "meets_target": all(r >= TARGET for r in auto_vs_best.values()),
        "load_average_at_end": os.getloadavg(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("auto", "tokens_per_s", "auto_vs_best", "meets_target")}, indent=1))


if __name__ == "__main__":
    main()
