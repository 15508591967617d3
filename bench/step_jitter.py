"""How much one and the same engine step varies on this machine, with nothing else running:
the floor under any ratio of a high percentile of inter-token latency to its median.

The bundled model as `baton up` serves it, one thread: a decode step of `--decodes`
sequences at a fixed context (the same inputs every time; the KV cache written once, then
only overwritten with the same rows) run `--steps` times back to back, and the same for a
step that also carries a prompt chunk. Reports each one's percentiles, p99 / p50, and the
process's page faults and involuntary context switches per step (to tell the engine's own
causes from the machine's: a step that allocates, or is preempted, shows them).

    python bench/step_jitter.py     # writes bench/results/step_jitter.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("results")


def percentiles(seconds: list[float]) -> dict:
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return round(ordered[int(q * (len(ordered) - 1))] * 1e3, 2)

    cells = {f"p{int(q * 100)}_ms": at(q) for q in (0.01, 0.5, 0.9, 0.99)}
    cells["max_ms"] = round(ordered[-1] * 1e3, 2)
    cells["p99_over_p50"] = round(cells["p99_ms"] / cells["p50_ms"], 2)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=RESULTS / "step_jitter.json")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # before the native library's OpenMP starts

    import torch
    from machine_info import machine_record

    from baton.engine import Engine, SamplingParams
    from baton.engine.scheduler import ScheduledBatch
    from baton.engine.sequence import Sequence
    from baton.engine.step_inputs import StepInputs

    torch.set_num_threads(1)
    engine = Engine(threads=1, kv_cache_memory_gb=0.5)
    runner = engine.runner
    params = SamplingParams(max_tokens=1)
    generator = torch.Generator().manual_seed(0)
    free_blocks = iter(range(runner.num_blocks))

    def sequence(name: str, tokens: int, computed: int) -> Sequence:
        ids = torch.randint(100, 20000, (tokens,), generator=generator).tolist()
        seq = Sequence(name, ids, params, num_computed_tokens=computed)
        seq.block_table = [next(free_blocks) for _ in range(-(-tokens // runner.block_size))]
        return seq

    decodes = [sequence(f"d{i}", args.context, args.context - 1) for i in range(args.decodes)]
    prompt = sequence("p", args.prompt_tokens, 0)
    cases = {"decode": ScheduledBatch(decodes=decodes),
             "mixed": ScheduledBatch(prefills=[(prompt, args.prompt_tokens)], decodes=decodes)}
    rows = {}
    for name, batch in cases.items():
        inputs, _ = StepInputs.from_batch(batch, runner.block_size)
        for _ in range(10):  # warm
            runner.execute(inputs)
        before = resource.getrusage(resource.RUSAGE_SELF)
        seconds = []
        for _ in range(args.steps):
            start = time.perf_counter()
            runner.execute(inputs)
            seconds.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        rows[name] = {**percentiles(seconds), "rows": len(inputs.token_ids),
                      "page_faults_per_step": round((after.ru_minflt - before.ru_minflt) / args.steps, 2),
                      "preemptions_per_step": round((after.ru_nivcsw - before.ru_nivcsw) / args.steps, 3)}
        print(name, rows[name], flush=True)
    record = {"machine": machine_record(threads=1), "decodes": args.decodes, "context": args.context,
              "prompt_tokens": args.prompt_tokens, "steps": args.steps, "dtype": str(engine.dtype),
              "kv_dtype": str(engine.kv_dtype), "quantization": engine.config.quantization, "cases": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
