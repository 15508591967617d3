"""The headline experiment: does disaggregation protect decode from long prefills?

Same machine, same workload for every setup: `--streams` concurrent short streams (64-token
prompts, 256 output tokens) plus a 2,000-token prompt every `--long-every` seconds.
  A  2 colocated workers, whole-prompt prefill (chunk 0)
  B  2 colocated workers, chunked prefill (256)
  C  1 prefill + 1 decode worker (short prompts prefill locally below the router's threshold,
     which weighs the decode worker's load and the prefill worker's queue)
  C0 the same as C with one long prompt near the start only (its ITL is the reference for C's p99)
Writes one JSON per setup plus a summary and timeline PNGs to bench/results/.

    python bench/interference.py --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from machine_info import machine_record
from serving_servers import router_placements, worker_steps

from baton.loadgen.main import add_arguments as bench_arguments
from baton.loadgen.main import bench, print_report
from baton.loadgen.records import records_from_json
from baton.loadgen.timeline import plot_timeline
from baton.local.runtime import LocalStack, StackSpec

SETUPS = {
    "A": dict(colocated=2, chunk_size=0),
    "B": dict(colocated=2, chunk_size=256),
    "C": dict(prefill=1, decode=1),
    "C0": dict(prefill=1, decode=1),
}


def run_setup(name: str, args: argparse.Namespace, out: Path, machine: dict) -> dict:
    spec = StackSpec(port=0, disagg_threshold=str(args.threshold), worker_args=list(args.worker_arg), **SETUPS[name])
    stack = LocalStack(spec).start()
    try:
        parser = argparse.ArgumentParser()
        bench_arguments(parser)
        longs_every = 1e9 if name == "C0" else args.long_every
        bench_args = parser.parse_args([
            "--url", stack.url, "--dataset", "interference", "--concurrency", str(args.streams),
            "--input-len", "64", "--output-len", "256", "--long-input-len", str(args.long_len),
            "--long-output-len", "8", "--long-every", str(longs_every), "--duration", str(args.duration),
            "--slo", args.slo, "--label", f"interference {name}", "--no-progress"])
        result = asyncio.run(bench(bench_args))
        # where the prompts prefilled, and each worker's steps by kind: what set the gaps
        result["prefill_placements"] = router_placements(stack.url)
        result["worker_steps"] = worker_steps(stack.url)
    finally:
        stack.stop()
    print_report(result)
    (out / f"interference_{name}.json").write_text(json.dumps({**result, "machine": machine}, indent=1))
    plot_timeline(records_from_json(result), str(out / f"interference_{name}.png"),
                  f"{name}: {SETUPS[name]}")
    return result


def stall_ms(requests: list[dict], kind: str = "short") -> dict:
    """The longest gaps between tokens of `kind` streams: p99.9 and max. A long prefill stalls
    each stream on its worker once, and where steps are fast those gaps are under 1% of all
    intervals (p99 does not see them)."""
    gaps = sorted(b - a for r in requests if r.get("kind") == kind
                  for a, b in zip(r.get("chunk_times") or [], (r.get("chunk_times") or [])[1:]))
    if not gaps:
        return {"itl_p999_ms": None, "itl_max_ms": None}
    return {"itl_p999_ms": gaps[min(len(gaps) - 1, int(len(gaps) * 0.999))] * 1e3, "itl_max_ms": gaps[-1] * 1e3}


def headline(results: dict[str, dict]) -> dict:
    def short(name: str) -> dict:
        r = results[name]
        return r.get("by_kind", {}).get("short", r["summary"])

    def long(name: str) -> dict | None:
        return results[name].get("by_kind", {}).get("long")

    table = {}
    for name, r in results.items():
        s, lg = short(name), long(name)
        table[name] = {"itl_p50_ms": s["itl"]["p50_ms"], "itl_p99_ms": s["itl"]["p99_ms"],
                       "short_ttft_p50_ms": s["ttft"]["p50_ms"],
                       "long_ttft_p50_ms": lg["ttft"]["p50_ms"] if lg else None,
                       "output_throughput": r["summary"]["output_throughput"],
                       "goodput": r["summary"]["goodput"], **stall_ms(r.get("requests", []))}
    checks = {}
    if {"A", "C", "C0"} <= set(table):
        c, a, c0 = table["C"], table["A"], table["C0"]
        checks["C_p99_itl_over_C0_p50"] = c["itl_p99_ms"] / c0["itl_p50_ms"]  # target <= 1.3
        checks["C_p99_itl_over_A_p99"] = c["itl_p99_ms"] / a["itl_p99_ms"]  # target <= 0.3
        if c["long_ttft_p50_ms"] and a["long_ttft_p50_ms"]:
            checks["C_long_ttft_over_A"] = c["long_ttft_p50_ms"] / a["long_ttft_p50_ms"]
        if c["itl_p999_ms"] and a["itl_p999_ms"]:  # the stalls themselves (no target of the issue's)
            checks["C_p999_itl_over_A_p999"] = c["itl_p999_ms"] / a["itl_p999_ms"]
    return {"setups": table, "checks": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default="C0,A,B,C")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long-len", type=int, default=2000)
    parser.add_argument("--long-every", type=float, default=3.0,
                        help="seconds between long prompts (a 2,000-token prefill takes ~2 s on one core)")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--threshold", default="auto",
                        help="router disaggregation threshold for C (auto: measured, weighs load)")
    parser.add_argument("--slo", default="ttft=5s,tpot=200ms")
    parser.add_argument("--worker-arg", action="append", default=[],
                        help="extra `baton worker` argument for every setup's workers, e.g. "
                        "--worker-arg=--prefill-cpu-priority=idle")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_record()  # before the stacks load the machine
    results = {name: run_setup(name, args, out, machine) for name in args.setups.split(",")}
    summary = {**headline(results), "worker_args": args.worker_arg, "machine": machine}
    (out / "interference_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
