"""Do the quantized weights in huge pages (native/huge_pages.py) make steps faster?

Two engines on the bundled model in one process, one with its weights gathered into one
mapping advised for 2 MiB pages, one with them in the allocator's pages (BATON_HUGE_PAGES=0),
taking turns `--rounds` times, so drift hits both alike: decode steps of 1 and 8 rows over
256-320 tokens of context (the median of `--decode-tokens` steps timed one by one), and a
256-token prompt. Each cell: best and median over the rounds; the ratios are the first
engine's time over the other's.

    .venv/bin/python bench/decode_pages.py --out bench/results/decode_pages.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode_pages.json"))
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch and the native library start

    import torch
    from machine_info import machine_record

    from baton.engine import Engine, SamplingParams

    torch.set_num_threads(args.threads)
    machine = machine_record(args.threads)
    engines, how = {}, {}
    for name, setting in {"huge_pages": "1", "allocator_pages": "0"}.items():
        os.environ["BATON_HUGE_PAGES"] = setting
        engines[name] = Engine(dtype="auto", quantization="auto", kv_cache_memory_gb=0.5, threads=args.threads,
                               enable_prefix_caching=False)
        how[name] = engines[name].runner.quantization
    os.environ.pop("BATON_HUGE_PAGES")
    rng = random.Random(0)

    def prompts(rows: int, tokens: int) -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(tokens)] for _ in range(rows)]

    def step_ms(engine, rows: int) -> float:
        """The median time of `--decode-tokens` decode steps of `rows` rows, timed one by one
        once every prompt has its first token."""
        params = SamplingParams(max_tokens=args.decode_tokens + 2, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts(rows, 256)]
        started: set[str] = set()
        while len(started) < rows:
            started.update(out.request_id for out in engine.step())
        times = []
        for _ in range(args.decode_tokens):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
        for rid in ids:
            engine.release(rid)
        return statistics.median(times) * 1e3

    def prefill_ms(engine) -> float:
        start = time.perf_counter()
        engine.generate(prompts(1, 256), SamplingParams(max_tokens=1))
        return (time.perf_counter() - start) * 1e3

    cases = {"decode_1_row_ms": lambda e: step_ms(e, 1), "decode_8_rows_ms": lambda e: step_ms(e, 8),
             "prefill_256_ms": prefill_ms}
    for engine in engines.values():  # warm-up: native library, allocator
        for measure in cases.values():
            measure(engine)
    samples = {name: {case: [] for case in cases} for name in engines}
    for round_ in range(args.rounds):
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        for case, measure in cases.items():
            for name in order:
                samples[name][case].append(measure(engines[name]))
        print(f"round {round_ + 1}: " + ", ".join(
            f"{case} {samples['huge_pages'][case][-1]:.2f} / {samples['allocator_pages'][case][-1]:.2f}"
            for case in cases), flush=True)
    cells = {name: {case: {"best": round(min(v), 3), "median": round(statistics.median(v), 3),
                           "samples": [round(x, 3) for x in v]} for case, v in by_case.items()}
             for name, by_case in samples.items()}
    ratios = {case: {"best": round(cells["huge_pages"][case]["best"] / cells["allocator_pages"][case]["best"], 4),
                     "median": round(cells["huge_pages"][case]["median"] / cells["allocator_pages"][case]["median"], 4)}
              for case in cases}
    report = {"bench": "decode_pages", "machine": machine, "rounds": args.rounds, "decode_tokens": args.decode_tokens,
              "engines": how, "cells": cells, "huge_over_allocator": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(ratios, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
