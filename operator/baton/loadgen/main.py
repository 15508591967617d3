"""`baton bench`: drive an OpenAI endpoint and report latency, throughput and goodput."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict

from baton.loadgen import datasets, runner
from baton.loadgen.stats import parse_slo, summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", choices=["random", "shared-prefix", "interference", "multi-turn"],
                        default="random")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (closed loop), or "
                        "the number of short streams (interference)")
    parser.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random lengths within ±ratio")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: shared tokens")
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=16, help="multi-turn: sessions (--concurrency "
                        "at once; --prefix-len system prompt, --input-len user turns, --output-len replies)")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    parser.add_argument("--think-time", type=float, default=0.0,
                        help="multi-turn: seconds between a reply and the session's next turn")
    parser.add_argument("--long-input-len", type=int, default=2000, help="interference: long prompt")
    parser.add_argument("--long-output-len", type=int, default=8)
    parser.add_argument("--long-every", type=float, default=4.0, help="interference: seconds between long prompts")
    parser.add_argument("--duration", type=float, default=30.0, help="interference: seconds to run")
    parser.add_argument("--slo", default=None, help="e.g. ttft=2s,tpot=100ms (goodput counts requests meeting all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--timeline-png", default=None)
    parser.add_argument("--label", default="", help="free text stored in the JSON")
    parser.add_argument("--no-progress", action="store_true")


class Progress:
    def __init__(self, total: int | None, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass
        self.failed = 0

    def __call__(self, record) -> None:
        self.failed += not record.success
        if self.bar is not None:
            self.bar.update(1)
            if self.failed:
                self.bar.set_postfix(failed=self.failed)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def bench(args: argparse.Namespace) -> dict:
    slo = parse_slo(args.slo)
    model = args.model or await runner.resolve_model(args.url, args.api_key)
    target = runner.Target(args.url, model, args.api_key)
    started = time.perf_counter()
    try:
        if args.dataset == "interference":
            rng = random.Random(args.seed)

            def make_short(i: int) -> datasets.RequestSpec:
                prompt = [rng.randrange(100, 30000) for _ in range(args.input_len)]
                return datasets.RequestSpec(prompt, args.output_len, kind="short")

            longs = datasets.interference_longs(args.duration, args.long_every, args.long_input_len,
                                                args.long_output_len, seed=args.seed + 1)
            progress = Progress(None, not args.no_progress)
            records = await runner.run_interference(target, make_short, args.concurrency, longs,
                                                    args.duration, progress)
        elif args.dataset == "multi-turn":
            sessions = datasets.multi_turn_dataset(args.conversations, args.turns, args.prefix_len, args.input_len,
                                                   args.output_len, args.output_len, args.seed)
            progress = Progress(sum(len(s) for s in sessions), not args.no_progress)
            records = await runner.run_conversations(target, sessions, args.concurrency, progress, args.think_time)
        else:
            if args.dataset == "random":
                specs = datasets.random_dataset(args.num_prompts, args.input_len, args.output_len,
                                                args.seed, args.range_ratio)
            else:
                specs = datasets.shared_prefix_dataset(args.num_prompts, args.prefix_len, args.input_len,
                                                       args.output_len, args.num_prefixes, args.seed)
            progress = Progress(len(specs), not args.no_progress)
            if args.request_rate:
                records = await runner.run_poisson(target, specs, args.request_rate, args.concurrency,
                                                   progress, args.seed)
            else:
                records = await runner.run_closed_loop(target, specs, args.concurrency, progress)
        progress.close()
    finally:
        await target.close()
    duration = time.perf_counter() - started
    result = {"label": args.label, "url": args.url, "model": model, "dataset": args.dataset,
              "settings": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
              "slo": asdict(slo), "summary": summarize(records, duration, slo)}
    kinds = sorted({r.kind for r in records})
    if len(kinds) > 1:
        result["by_kind"] = {k: summarize(records, duration, slo, kind=k) for k in kinds}
    result["requests"] = [{**asdict(r), "tpot": r.tpot} for r in records]
    return result


def print_report(result: dict) -> None:
    s = result["summary"]
    print(f"\n{result['dataset']}: {s['completed']}/{s['requests']} completed in {s['duration_s']:.1f}s "
          f"({s['failed']} failed)")
    print(f"  throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s")
    if s["goodput"] is not None:
        print(f"  goodput: {s['goodput']:.2f} req/s ({100 * s['slo_attainment']:.0f}% met the SLOs)")
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = s[name]
        if d["median_ms"] is None:
            continue
        print(f"  {name.upper():5} ms  mean {d['mean_ms']:8.1f}  p50 {d['p50_ms']:8.1f}  "
              f"p90 {d['p90_ms']:8.1f}  p99 {d['p99_ms']:8.1f}")


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(bench(args))
    print_report(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if args.timeline_png:
        from baton.loadgen.records import records_from_json
        from baton.loadgen.timeline import plot_timeline

        plot_timeline(records_from_json(result), args.timeline_png, args.label)
    return 0 if result["summary"]["completed"] else 1
