"""How long a long prompt takes to prefill on the bundled model as a prefill worker runs it
(dtype and quantization `auto`, chunks of --chunk-size tokens, one thread by default): the
time to its first token, best of --runs fresh prompts after a warm-up one. At 2,000 tokens
the prompt attention is about half of it (its cost grows with the context, the products'
does not), so this is where a change to the attention shows end to end. Two builds compare
by running this once each, alternately (PYTHONPATH=<other checkout>/worker for the other).

    python bench/long_prefill.py --out bench/results/long_prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 1024])
    parser.add_argument("--chunk-size", type=int, default=512, help="the engine's default; 0: whole prompts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch and the native library start

    import torch
    from machine_info import machine_record

    from baton.engine import Engine, SamplingParams

    machine = machine_record(args.threads)
    engine = Engine(dtype="auto", quantization="auto", kv_cache_memory_gb=0.5, threads=args.threads,
                    chunk_size=args.chunk_size, enable_prefix_caching=False)
    results = {}
    for length in args.tokens:
        seconds = []
        for run in range(args.runs + 1):  # the first warms up
            ids = torch.randint(100, 20000, (length,), generator=torch.Generator().manual_seed(run)).tolist()
            start = time.perf_counter()
            engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
            seconds.append(time.perf_counter() - start)
        best = min(seconds[1:])
        results[str(length)] = {"best_s": round(best, 4), "runs_s": [round(s, 4) for s in seconds[1:]],
                                "ms_per_token": round(best / length * 1e3, 3)}
        print(f"{length:>6} tokens: best {best:.3f} s ({best / length * 1e3:.3f} ms a token)", flush=True)
    report = {"bench": "long_prefill", "chunk_size": args.chunk_size, "kernels": engine.runner.quantization,
              "machine": machine, "prompts": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
