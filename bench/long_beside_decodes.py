"""A long prompt arriving at a colocated worker beside running decodes, as that worker's
budget chunks it: the bundled model as `baton up` serves it (dtype and quantization
`auto`, one thread), calibrated as a worker calibrates at start, `--decodes` streams
running, then a `--tokens`-token prompt. Reports its time to first token, its chunks, the
longest step its decodes waited through (the TPOT objective is 30 ms; a colocated worker's
steps may run to its bank of it), and the prompt cost fitted at calibration and after.
Two builds compare by running this once each, alternately (PYTHONPATH=<other
checkout>/worker for the other).

    python bench/long_beside_decodes.py --out bench/results/long_beside_decodes.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def fitted(engine) -> dict:
    cost = engine.step_costs.prompt_cost()
    return {"fixed_ms": round(cost.fixed * 1e3, 3), "per_token_ms": round(cost.per_token * 1e3, 4),
            "per_context_us": round(cost.per_context * 1e6, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--decodes", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2, help="fresh engines, one long prompt each")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch and the native library start

    from machine_info import machine_record

    from baton.engine import Engine, SamplingParams
    from baton.engine.calibration import calibrate

    machine = machine_record(args.threads)
    runs = []
    for run in range(args.runs):
        engine = Engine(dtype="auto", quantization="auto", kv_cache_memory_gb=1.0, threads=args.threads, role="both")
        said = calibrate(engine)
        at_start = fitted(engine)
        vocab = engine.model_config.vocab_size
        streams = SamplingParams(max_tokens=100_000, ignore_eos=True)
        for i in range(args.decodes):
            engine.add_request([(7 + 13 * i + 17 * j + run) % vocab for j in range(64)], streams, f"stream-{i}")
        for _ in range(40):  # the streams' prompts, then decodes alone
            engine.step()
        engine.add_request([(3 + 29 * j + run) % vocab for j in range(args.tokens)],
                           SamplingParams(max_tokens=1, ignore_eos=True), "long")
        long = engine.sequences["long"]
        chunks, steps, started = [], [], time.perf_counter()
        while not long.is_finished:
            before, step_started = long.num_computed_tokens, time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - step_started)
            chunks.append(long.num_computed_tokens - before)
        first_token_s = time.perf_counter() - started
        runs.append({"calibration": said, "fit_at_start": at_start, "fit_after": fitted(engine),
                     "first_token_s": round(first_token_s, 3), "steps": len(steps),
                     "longest_step_ms": round(max(steps) * 1e3, 1),
                     "mean_step_ms": round(sum(steps) / len(steps) * 1e3, 1), "chunks": chunks})
        print(f"run {run}: first token {first_token_s:.2f} s in {len(steps)} steps, longest {max(steps) * 1e3:.1f} ms; "
              f"context cost {at_start['per_context_us']} -> {runs[-1]['fit_after']['per_context_us']} us a unit",
              flush=True)
    report = {"bench": "long_beside_decodes", "tokens": args.tokens, "decodes": args.decodes, "machine": machine,
              "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
