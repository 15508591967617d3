"""`baton simulate`: the controller against the best static split and an hourly oracle."""

from __future__ import annotations

import argparse
import json

from baton.sim.hardware import GPUS, MODELS, worker_perf
from baton.sim.scenario import ScenarioConfig, compare


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=64, help="fleet size N (prefill + decode)")
    parser.add_argument("--hours", type=float, default=24.0, help="simulated hours (one full mix cycle)")
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS))
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument("--gpus-per-worker", type=int, default=None)
    parser.add_argument("--calibration", default=None, help="bench JSON with measured worker performance")
    parser.add_argument("--ttft-slo", type=float, default=1.0, help="seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.05, help="seconds")
    parser.add_argument("--utilisation", type=float, default=ScenarioConfig.utilisation,
                        help="planned utilisation at the peak (how tightly the fleet is provisioned)")
    parser.add_argument("--reshard-s", type=float, default=30.0, help="seconds a conversion reshards")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH.png", help="save x, y, load and latency over time")


def run(args: argparse.Namespace) -> int:
    perf = worker_perf(args.model, args.gpu, args.gpus_per_worker, calibration=args.calibration)
    config = ScenarioConfig(workers=args.workers, hours=args.hours, ttft_slo_s=args.ttft_slo,
                            tpot_slo_s=args.tpot_slo, utilisation=args.utilisation,
                            reshard_s=args.reshard_s, seed=args.seed)
    result = compare(perf, config)
    report = result.report()
    report["scenario"]["model"] = "calibrated" if args.calibration else args.model
    report["scenario"]["gpu"] = None if args.calibration else args.gpu
    if args.plot:
        from baton.sim.plot import save_plot  # matplotlib only when asked

        save_plot(result, args.plot)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0


def render(report: dict) -> str:
    s = report["scenario"]
    lines = [
        f"{s['workers']} workers, {s['hours']:g} h, {s.get('model')} on {s.get('gpu')}, peak {s['peak_rate_rps']:.1f} req/s, "
        f"SLO TTFT {s['ttft_slo_s']:g}s TPOT {s['tpot_slo_s'] * 1000:g}ms",
        f"{'strategy':<22}{'goodput req/s':>14}{'SLO attained':>14}{'conversions':>13}{'mean TTFT s':>13}",
    ]
    for name, row in report["strategies"].items():
        label = f"{name} ({row['split']})" if "split" in row else name
        lines.append(f"{label:<22}{row['goodput_rps']:>14.2f}{row['slo_attainment']:>14.1%}"
                     f"{row['conversions']:>13d}{row['mean_ttft_s']:>13.3f}")
    r = report["ratios"]
    lines.append(f"controller / best static = {r['controller_vs_static']:.3f}   "
                 f"controller / hourly oracle = {r['controller_vs_oracle']:.3f}")
    lines.append("targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in report["targets"].items()))
    lines.append(f"simulated in {report['elapsed_s']:.1f}s")
    return "\n".join(lines)
