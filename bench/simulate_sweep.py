"""The controller's gain over a static split depends on how tightly the fleet is provisioned.

Runs `baton simulate`'s comparison (64 workers, 24 h, Llama-3-8B on H100) at several planned
peak utilisations and writes every ratio to bench/results/simulate_sweep.json, so the headline
number is read next to its neighbours.

    python bench/simulate_sweep.py [--utilisations 0.8,0.85,0.9]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baton.sim.hardware import worker_perf
from baton.sim.scenario import ScenarioConfig, compare

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utilisations", default="0.8,0.85,0.9")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--hours", type=float, default=24.0)
    args = parser.parse_args()
    perf = worker_perf("llama-3-8b", "h100")
    rows = []
    for u in (float(x) for x in args.utilisations.split(",")):
        report = compare(perf, ScenarioConfig(workers=args.workers, hours=args.hours, utilisation=u)).report()
        strategies = report["strategies"]
        rows.append({
            "utilisation": u,
            "peak_rate_rps": report["scenario"]["peak_rate_rps"],
            "controller_vs_static": report["ratios"]["controller_vs_static"],
            "controller_vs_oracle": report["ratios"]["controller_vs_oracle"],
            "oracle_vs_static": strategies["hourly_oracle"]["goodput_rps"] / strategies["best_static"]["goodput_rps"],
            "controller_slo_attainment": strategies["controller"]["slo_attainment"],
            "static_slo_attainment": strategies["best_static"]["slo_attainment"],
            "static_split": strategies["best_static"]["split"],
            "controller_conversions": strategies["controller"]["conversions"],
        })
        print(json.dumps(rows[-1]))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "simulate_sweep.json"
    out.write_text(json.dumps({"workers": args.workers, "hours": args.hours, "model": "llama-3-8b", "gpu": "h100",
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
