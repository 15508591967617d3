"""Steps that carry prompt tokens, on the native step against torch's path, on the bundled
model as `baton up` serves it (dtype and quantization `auto`). Each case is one step: B
running decodes (contexts of 300 tokens) beside a prompt chunk of P tokens starting at
position 0 (or at START: a chunk late in a long prompt), or a prompt alone. Every case on
both paths takes its turn in each of `--repeats` rounds, and each cell is its best, so drift
hits all alike (where native/prompt_steps.py sends a step to torch's path anyway,
`native_step_ran` is false and both columns are torch's). A worker that prefills in small chunks to keep its decodes' time per
token pays each step's fixed cost on every chunk: this is that cost.

    python bench/mixed_steps.py --threads 1   # writes bench/results/mixed_steps.json
    python bench/mixed_steps.py --cases 4,12,900 4,12,0 --out FILE   # chunks late and early
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("results")
# (decodes, prompt tokens, where the chunk starts in its prompt); 4 + 12, 16, 20 and 8 + 8,
# 16 step across the bf16 products' passes of 8 rows (quant/placement.py BF16_ROW_TILE); 12
# rows (12 decodes, 4 + 8) and 16 and 32 decodes alone run on the panel engines (from
# PANEL_MIN_ROWS); --cases times others
CASES = tuple((*c, 0) for c in ((4, 12), (4, 16), (4, 20), (4, 64), (8, 8), (8, 16), (8, 64), (4, 256), (0, 256),
                                 (0, 512), (0, 1024), (8, 0), (4, 0), (12, 0), (4, 8), (16, 0), (32, 0)))
DECODE_CONTEXT = 300


def case(text: str) -> tuple[int, int, int]:
    """A step given as DECODES,PROMPT_TOKENS[,START] (at least one row; the chunk from
    position START of its prompt, 0 by default)."""
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected DECODES,PROMPT_TOKENS[,START] such as 4,16 or 4,12,900, "
                                         f"got {text!r}")
    decodes, tokens, start = (*numbers, 0)[:3]
    if decodes < 0 or tokens < 0 or start < 0 or decodes + tokens == 0 or (start and not tokens):
        raise argparse.ArgumentTypeError(f"a step needs a row, no negative count, and prompt tokens where it "
                                         f"gives START; got {text!r}")
    return decodes, tokens, start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "mixed_steps.json")
    parser.add_argument("--cases", nargs="+", metavar="DECODES,PROMPT_TOKENS[,START]", type=case,
                        help="steps to time instead of the default set, e.g. 10,0 4,6 4,12,900")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before the native library's OpenMP starts

    import torch
    from machine_info import machine_record

    from baton.engine import Engine, SamplingParams
    from baton.engine.native import prompt_steps
    from baton.engine.scheduler import ScheduledBatch
    from baton.engine.sequence import Sequence
    from baton.engine.step_inputs import StepInputs

    torch.set_num_threads(args.threads)
    engine = Engine(threads=args.threads, kv_cache_memory_gb=0.5)
    runner, native = engine.runner, engine.runner.native
    if native is None or not native.prompts.max_rows:
        raise SystemExit(f"the native step does not run prompt steps here: {native and native.prompts.reason}")
    block, blocks = runner.block_size, runner.num_blocks
    params = SamplingParams(max_tokens=1)
    generator = torch.Generator().manual_seed(0)
    next_block = iter(())

    def sequence(name: str, tokens: int, computed: int) -> Sequence:
        ids = torch.randint(100, 20000, (tokens,), generator=generator).tolist()
        seq = Sequence(name, ids, params, num_computed_tokens=computed)
        seq.block_table = [next(next_block) for _ in range(-(-tokens // block))]
        return seq

    def batch(decodes: int, prompt: int, start: int) -> ScheduledBatch:
        running = [sequence(f"d{i}", DECODE_CONTEXT, DECODE_CONTEXT - 1) for i in range(decodes)]
        return ScheduledBatch(prefills=[(sequence("p", start + prompt, start), prompt)] if prompt else [],
                              decodes=running)

    def timed(b: ScheduledBatch, use_native: bool) -> float:
        runner.native = native if use_native else None
        start = time.perf_counter()
        runner.run(b)
        return time.perf_counter() - start

    cases = args.cases or CASES
    batches = []
    for decodes, prompt, start in cases:
        next_block = iter(range(blocks))  # each case's sequences from the pool's start
        batches.append(batch(decodes, prompt, start))
    for b in batches:
        timed(b, True), timed(b, False)  # warm both
    best = [{"native": float("inf"), "torch": float("inf")} for _ in cases]
    for _ in range(args.repeats):  # every case and path in turn, so drift hits all alike
        for b, cell in zip(batches, best):
            cell["native"] = min(cell["native"], timed(b, True))
            cell["torch"] = min(cell["torch"], timed(b, False))
    rows = []
    for (decodes, prompt, start), b, cell in zip(cases, batches, best):
        inputs, _ = StepInputs.from_batch(b, block)
        on_native = not prompt or prompt_steps.runs(native.prompts, len(inputs.token_ids), inputs.prompt_rows_by_context())
        row = {"decodes": decodes, "prompt_tokens": prompt, "chunk_start": start, "native_step_ran": on_native,
               "native_ms": round(cell["native"] * 1e3, 2),
               "torch_ms": round(cell["torch"] * 1e3, 2), "torch_over_native": round(cell["torch"] / cell["native"], 2)}
        print(row, flush=True)
        rows.append(row)
    runner.native = native
    record = {"machine": machine_record(), "threads": args.threads, "dtype": str(engine.dtype),
              "kv_dtype": str(engine.kv_dtype), "quantization": engine.config.quantization,
              "native_prompt_steps": native.prompts.reason, "decode_context": DECODE_CONTEXT, "cases": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
