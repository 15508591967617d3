"""Tensor parallelism on this machine: TP=1 against TP=2, side by side in one run.

A 1,024-token prefill, batch-1 decode and batch-16 decode, each run by both engines in turn
(so drift hits both alike), median of `--runs`; for TP=2 also the share of the time rank 0
spends in collectives (all-reduce of the row-parallel outputs, the vocab-parallel head).

The model is SmolLM2-135M's shape (hidden 576, 30 layers, 49,152-token vocabulary) with 8
query and 4 KV heads, random weights: SmolLM2's own 9 and 3 heads do not split in two. TP=1
runs on every core (`--threads`); each TP=2 rank runs on a core of its own with one thread.

    .venv/bin/python bench/tp.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from machine_info import machine_record

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=8, num_key_value_heads=4, head_dim=72, max_position_embeddings=2048)


def model_folder() -> Path:
    from tests.engine.tiny_llama import write_tiny_llama

    folder = ROOT / "bench" / ".cache" / "tp-smollm2-shape"
    if not (folder / "model.safetensors").exists():
        write_tiny_llama(folder, **SHAPE)
    return folder


def collective_seconds(engine) -> float:
    comm = getattr(engine.runner, "comm", None)
    return comm.collective_seconds if comm is not None else 0.0


def timed(engine, fn) -> tuple[float, float]:
    """(wall seconds, of which in collectives on rank 0)."""
    before = collective_seconds(engine)
    started = time.perf_counter()
    fn(engine)
    return time.perf_counter() - started, collective_seconds(engine) - before


def main() -> None:
    import torch

    from baton.engine import Engine, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--out", default="bench/results/tp.json")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    machine = machine_record(args.threads)
    folder = model_folder()
    common = dict(dtype="float32", quantization="none", chunk_size=0, max_num_batched_tokens=4096,
                  num_kv_blocks=1024)
    engines = {"tp1": Engine(model=str(folder), threads=args.threads, **common),
               "tp2": Engine(model=str(folder), threads=1, tensor_parallel_size=2, cpu_cores=cores[:2], **common)}
    torch.set_num_threads(args.threads)  # the TP=2 engine set one thread for its rank 0
    rng = random.Random(0)
    n, t = args.decode_tokens, args.prefill_tokens
    prompt = lambda length: [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(length)]  # noqa: E731

    def set_threads(name: str) -> None:
        torch.set_num_threads(args.threads if name == "tp1" else 1)

    phases = {
        "prefill": lambda e: e.generate([prompt(t)], SamplingParams(max_tokens=1)),
        "decode_b1": lambda e: e.generate([prompt(16)], SamplingParams(max_tokens=n, ignore_eos=True)),
        "decode_b16": lambda e: e.generate([prompt(16) for _ in range(16)], SamplingParams(max_tokens=n, ignore_eos=True)),
    }
    for name, engine in engines.items():  # warm-up: native library, caches, allocator
        set_threads(name)
        for fn in phases.values():
            fn(engine)
    samples = {f"{phase}_{name}": [] for phase in phases for name in engines}
    shares = {phase: [] for phase in phases}
    for _ in range(args.runs):
        for phase, fn in phases.items():
            for name, engine in engines.items():
                set_threads(name)
                wall, comm = timed(engine, fn)
                samples[f"{phase}_{name}"].append(wall)
                if name == "tp2":
                    shares[phase].append(comm / wall)
    median = {k: statistics.median(v) for k, v in samples.items()}
    tokens = {"prefill": t, "decode_b1": n, "decode_b16": 16 * n}
    results = {}
    for phase in phases:
        one, two = median[f"{phase}_tp1"], median[f"{phase}_tp2"]
        results[phase] = {
            "tp1_seconds": round(one, 4), "tp2_seconds": round(two, 4),
            "tp1_tokens_per_s": round(tokens[phase] / one, 1), "tp2_tokens_per_s": round(tokens[phase] / two, 1),
            "tp2_speedup": round(one / two, 3),
            "tp2_collective_share": round(statistics.median(shares[phase]), 3),
        }
        print(f"{phase:11s} TP=1 {one * 1e3:8.1f} ms  TP=2 {two * 1e3:8.1f} ms  speed-up {one / two:5.2f}x  "
              f"collectives {results[phase]['tp2_collective_share']:.0%} of TP=2's time")
    record = {"bench": "tp", "machine": machine, "model": {"shape": SHAPE, "weights": "random"},
              "settings": {**common, "runs": args.runs, "decode_tokens": n, "prefill_tokens": t,
                           "tp1_threads": args.threads, "tp2_threads_per_rank": 1, "tp2_cores": cores[:2]},
              "results": results, "samples": samples}
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
