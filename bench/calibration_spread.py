"""How far apart a worker's start-up calibrations land (engine/calibration.py), the way it
measures now against the way it measured before: prompts chunked by the very budget being
measured, one of each size, every step kept ("budgeted"), or whole, three of each size and
their median kept ("whole", the current code). The bundled model as `baton up` serves it,
one thread; the two ways take turns, `--runs` each. Per run: the decode line at 1 and 8
streams, the prompt line's fixed part, per-token and per-unit-of-attention costs and margin,
and the budget that results beside 4 decodes under the default objective.
`--neighbour` shares the core with a spinning process, as two workers starting together on a
two-core machine, with the router and a client, share theirs.

    python bench/calibration_spread.py --runs 20 --neighbour   # bench/results/calibration_spread.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).with_name("results")
SPIN = "while True: pass"


def quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {f"p{int(q * 100)}": round(ordered[int(q * (len(ordered) - 1))], 4) for q in (0, 0.1, 0.5, 0.9, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--cpu", type=int, default=0, help="the core this process (and the neighbour) runs on")
    parser.add_argument("--neighbour", action="store_true", help="a spinning process on the same core")
    parser.add_argument("--out", type=Path, default=RESULTS / "calibration_spread.json")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    os.environ["OMP_NUM_THREADS"] = "1"  # before the native library's OpenMP starts
    os.sched_setaffinity(0, {args.cpu})

    import torch
    from machine_info import machine_record

    from baton.engine import Engine, calibration
    from baton.engine.config import DEFAULT_TPOT_OBJECTIVE_S
    from baton.engine.step_budget import StepCosts, prefill_token_budget

    torch.set_num_threads(1)
    engine = Engine(threads=1, kv_cache_memory_gb=0.5)
    ceiling = engine.config.max_num_batched_tokens
    whole = (calibration._budget_lifted, calibration.PROMPT_ROUNDS, StepCosts.keep_median_prompt_steps)

    def budgeted():  # the earlier way: no lifting, one round, every step kept
        calibration._budget_lifted, calibration.PROMPT_ROUNDS = lambda e: contextlib.nullcontext(), 1
        StepCosts.keep_median_prompt_steps = lambda self: None

    def current():
        calibration._budget_lifted, calibration.PROMPT_ROUNDS, StepCosts.keep_median_prompt_steps = whole

    ways = {"budgeted": budgeted, "whole": current}
    found: dict[str, list[dict]] = {name: [] for name in ways}
    neighbour = None
    if args.neighbour:
        neighbour = subprocess.Popen(["taskset", "-c", str(args.cpu), sys.executable, "-c", SPIN])
    try:
        for run in range(args.runs):
            for name, use in ways.items():
                use()
                said = calibration.calibrate(engine)
                costs = engine.step_costs
                cost = costs.prompt_cost()
                row = {"said": said, "decode_1_ms": round(costs.decode_step_s(1) * 1e3, 2),
                       "decode_8_ms": round(costs.decode_step_s(8) * 1e3, 2),
                       "fixed_ms": round(cost.fixed * 1e3, 2), "per_token_ms": round(cost.per_token * 1e3, 4),
                       "per_context_us": round(cost.per_context * 1e6, 4), "margin_ms": round(cost.margin * 1e3, 2),
                       "budget_beside_4": prefill_token_budget(DEFAULT_TPOT_OBJECTIVE_S, 4, costs, ceiling)}
                found[name].append(row)
                print(run, name, row, flush=True)
    finally:
        current()
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    summary = {name: {"per_token_ms": quantiles([r["per_token_ms"] for r in rows]),
                      "fixed_ms": quantiles([r["fixed_ms"] for r in rows]),
                      "per_context_us": quantiles([r["per_context_us"] for r in rows]),
                      "margin_ms": quantiles([r["margin_ms"] for r in rows]),
                      "budget_beside_4": quantiles([r["budget_beside_4"] for r in rows]),
                      "budget_at_ceiling": sum(r["budget_beside_4"] >= ceiling for r in rows)}
               for name, rows in found.items()}
    out = {"machine": machine_record(), "runs": args.runs, "neighbour": args.neighbour,
           "objective_ms": DEFAULT_TPOT_OBJECTIVE_S * 1e3, "ceiling": ceiling, "summary": summary, "found": found}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
