"""The controller against the best static split and the hourly oracle, across fleet sizes and
planned peak utilisations.

Runs `baton simulate`'s comparison (24 h, Llama-3-8B on H100) for every fleet size and
utilisation given and writes every ratio to bench/results/simulate_sweep.json, so the
headline numbers are read next to their neighbours.

    python bench/simulate_sweep.py [--workers 16,64,256,1000] [--utilisations 0.8,0.85,0.9]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baton.sim.hardware import worker_perf
from baton.sim.scenario import ScenarioConfig, compare

RESULTS = Path(__file__).parent / "results"


def row(workers: int, utilisation: float, report: dict) -> dict:
    strategies = report["strategies"]
    controller, static, oracle = (strategies[k] for k in ("controller", "best_static", "hourly_oracle"))
    return {
        "workers": workers,
        "utilisation": utilisation,
        "peak_rate_rps": report["scenario"]["peak_rate_rps"],
        "controller_goodput_rps": controller["goodput_rps"],
        "static_goodput_rps": static["goodput_rps"],
        "oracle_goodput_rps": oracle["goodput_rps"],
        "controller_vs_static": report["ratios"]["controller_vs_static"],
        "controller_vs_oracle": report["ratios"]["controller_vs_oracle"],
        "oracle_vs_static": oracle["goodput_rps"] / static["goodput_rps"],
        "controller_slo_attainment": controller["slo_attainment"],
        "static_slo_attainment": static["slo_attainment"],
        "static_split": static["split"],
        "controller_conversions": controller["conversions"],
        "oracle_conversions": oracle["conversions"],
        "controller_peak_conversions_in_flight": controller["peak_conversions_in_flight"],
        "controller_peak_conversions_per_hour": controller["peak_conversions_per_hour"],
        "simulated_in_s": report["elapsed_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,64,256,1000", help="fleet sizes, comma-separated")
    parser.add_argument("--utilisations", default="0.85", help="planned peak utilisations, comma-separated")
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "simulate_sweep.json")
    args = parser.parse_args()
    perf = worker_perf("llama-3-8b", "h100")
    rows = []
    for workers in (int(n) for n in args.workers.split(",")):
        for u in (float(x) for x in args.utilisations.split(",")):
            report = compare(perf, ScenarioConfig(workers=workers, hours=args.hours, utilisation=u)).report()
            rows.append(row(workers, u, report))
            print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"hours": args.hours, "model": "llama-3-8b", "gpu": "h100", "rows": rows},
                                   indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
