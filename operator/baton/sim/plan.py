"""`baton plan`: a recommended xPyD for a model, hardware, link, workload and SLOs.

Every number printed is a formula from `baton.autoscaler.sizing` with its inputs beside
it, so an operator can check the arithmetic. The worker model is the roofline in
`baton.sim.hardware`.
"""

from __future__ import annotations

import argparse
import json
import math

from baton.autoscaler import sizing
from baton.sim.hardware import GPUS, MODELS, RooflinePerf

TABLE_CONTEXTS = (1024, 4096, 8192, 16000, 32768, 131072)
TABLE_LINKS_GBPS = (200, 400, 800, 7200)  # 25, 50, 100 and 900 GB/s: HDR, NDR, XDR, NVLink


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3-70b", choices=sorted(MODELS))
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument("--gpus-per-worker", type=int, default=None)
    parser.add_argument("--link-gbps", type=float, default=400.0, help="prefill->decode link per worker, Gbit/s")
    parser.add_argument("--rate", type=float, help="arrival rate, requests/s (required without --day)")
    parser.add_argument("--input-len", type=float, help="mean prompt tokens (required without --day)")
    parser.add_argument("--output-len", type=float, help="mean generated tokens (required without --day)")
    parser.add_argument("--hit-rate", type=float, default=0.0, help="prefix cache hit fraction of prompt tokens")
    parser.add_argument("--local-share", type=float, default=0.0, help="share of prompt tokens prefilled on decode")
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.05, help="seconds")
    parser.add_argument("--utilisation", type=float, default=0.8, help="planned utilisation of each pool")
    parser.add_argument("--workers", type=int, default=None, help="fixed fleet size N: also show the best x+y=N")
    parser.add_argument("--fixed-overhead", type=float, default=0.02, help="remote-path overhead O_fixed, s")
    parser.add_argument("--transfer-budget", type=float, default=0.2, help="seconds of TTFT the wire may take")
    parser.add_argument("--day", action="store_true",
                        help="plan the fixed fleet of --workers over `baton simulate`'s drifting day: its split, "
                             "conversions per hour and the disruption budget they need")
    parser.add_argument("--hours", type=float, default=24.0, help="with --day: length of the day")
    parser.add_argument("--reshard-s", type=float, default=30.0, help="with --day: seconds a conversion reshards")
    parser.add_argument("--json", action="store_true")


def build_plan(args: argparse.Namespace) -> dict:
    model, gpu = MODELS[args.model], GPUS[args.gpu]
    link = args.link_gbps * 1e9 / 8
    perf = RooflinePerf(model, gpu, args.gpus_per_worker, link)
    kv = model.kv_per_token
    lam, l_in, l_out, h = args.rate, args.input_len, args.output_len, args.hit_rate
    supply = perf.prefill_tokens_per_s(l_in)
    context = sizing.resident_context(l_in, l_out)
    intercept = float(perf.decode_step_s(0.0, context))
    per_seq = (float(perf.decode_step_s(64.0, context)) - intercept) / 64.0
    transfer = sizing.transfer_seconds(l_in, kv, link)  # decode needs the whole prompt's KV
    exposed = sizing.exposed_transfer_seconds(transfer, model.n_layers)
    load = sizing.FleetLoad(lam, l_in, l_out, h, supply, intercept, per_seq, perf.kv_capacity_tokens,
                            exposed, args.ttft_slo, args.tpot_slo, args.local_share)
    x, y = sizing.elastic_pool_sizes(load, args.utilisation, args.utilisation, (1, 10**6), (1, 10**6))
    at_plan = sizing.assess_split(load, x, y)
    kv_bound = perf.kv_capacity_tokens / context
    tpot_bound = sizing.tpot_bandwidth_batch_bound(args.tpot_slo, intercept, per_seq)
    demand = sizing.fleet_link_demand(lam * (1 - args.local_share), l_in, kv)
    plan = {
        "recommended": f"{x}P{y}D",
        "workers": {"prefill": x, "decode": y, "gpus_per_worker": perf.gpus, "gpus": (x + y) * perf.gpus},
        "kv_bytes_per_token": {"inputs": {"n_layers": model.n_layers, "n_kv_heads": model.n_kv_heads,
                                          "head_dim": model.head_dim, "dtype_bytes": model.dtype_bytes},
                               "output": kv},
        "prefill": {"inputs": {"rate_rps": lam, "input_len": l_in, "hit_rate": h, "local_share": args.local_share,
                               "supply_tokens_per_s": supply, "utilisation": args.utilisation},
                    "demand_tokens_per_s": load.prefill_demand, "workers": x,
                    "utilisation_at_plan": at_plan.prefill_utilisation, "service_s": load.prefill_service_s},
        "transfer": {"inputs": {"tokens": l_in, "kv_bytes_per_token": kv, "link_bytes_per_s": link,
                                "n_layers": model.n_layers},
                     "bytes": l_in * kv, "transfer_s": transfer, "exposed_s": exposed,
                     "pipelining_hides_transfer": sizing.pipelining_hides_transfer(1 / supply, kv, link),
                     "fleet_demand_bytes_per_s": demand, "fleet_link_bytes_per_s": x * link,
                     "link_fits": sizing.link_fits(demand, x * link)},
        "ttft": {"inputs": {"service_s": load.prefill_service_s, "utilisation": at_plan.prefill_utilisation,
                            "exposed_transfer_s": exposed},
                 "predicted_s": at_plan.ttft_s, "slo_s": args.ttft_slo},
        "decode": {"inputs": {"kv_capacity_tokens": perf.kv_capacity_tokens, "resident_context_tokens": context,
                              "step_intercept_s": intercept, "step_per_seq_s": per_seq, "tpot_slo_s": args.tpot_slo,
                              "utilisation": args.utilisation},
                   "kv_batch_bound": kv_bound, "tpot_batch_bound": tpot_bound, "batch_cap": min(kv_bound, tpot_bound),
                   "concurrency": at_plan.concurrency, "workers": y, "predicted_tpot_s": at_plan.tpot_s},
        "disaggregation_threshold": {
            "inputs": {"fixed_overhead_s": args.fixed_overhead, "prefill_s_per_token": 1 / supply,
                       "kv_bytes_per_token": kv, "link_bytes_per_s": link},
            "tokens": _finite(sizing.disaggregation_threshold(args.fixed_overhead, 1 / supply, kv, link))},
        "meets_slo": at_plan.meets_slo,
        "kv_transfer_table": transfer_table(kv, model.n_layers, args.link_gbps, args.transfer_budget),
    }
    if args.workers:
        best = sizing.best_fixed_split(load, args.workers)
        plan["fixed_fleet"] = {"workers": args.workers, "split": f"{best.prefill_workers}P{best.decode_workers}D",
                               "headroom": best.headroom, "meets_slo": best.meets_slo,
                               "ttft_s": best.ttft_s, "tpot_s": best.tpot_s}
    return plan


def transfer_table(kv: int, n_layers: int, link_gbps: float, budget_s: float) -> list[dict]:
    """Context length x link: KV size, serialized and exposed time, feasibility in the budget."""
    rows = []
    for gbps in sorted({link_gbps, *TABLE_LINKS_GBPS}):
        link = gbps * 1e9 / 8
        for tokens in TABLE_CONTEXTS:
            full = sizing.transfer_seconds(tokens, kv, link)
            rows.append({"context_tokens": tokens, "link_gbps": gbps, "link_GBps": link / 1e9,
                         "bytes": sizing.kv_bytes(tokens, kv), "transfer_s": full,
                         "exposed_s": sizing.exposed_transfer_seconds(full, n_layers),
                         "feasible": sizing.transfer_feasible(full, budget_s)})
    return rows


def render(plan: dict) -> str:
    p, d, t, w = plan["prefill"], plan["decode"], plan["transfer"], plan["workers"]
    lines = [
        f"recommended: {plan['recommended']} ({w['gpus']} GPUs, {w['gpus_per_worker']} per worker); "
        f"meets SLOs: {plan['meets_slo']}",
        f"kv bytes/token = 2 x layers x kv_heads x head_dim x dtype = {plan['kv_bytes_per_token']['output']:,} "
        f"{plan['kv_bytes_per_token']['inputs']}",
        f"prefill demand = rate (1-h)(1-local) L_in = {p['demand_tokens_per_s']:,.0f} tok/s; supply "
        f"{p['inputs']['supply_tokens_per_s']:,.0f} tok/s/worker at rho {p['inputs']['utilisation']} -> x = {p['workers']}",
        f"ttft = prefill {plan['ttft']['inputs']['service_s']:.3f}s + M/D/1 wait at rho "
        f"{plan['ttft']['inputs']['utilisation']:.2f} + exposed {t['exposed_s'] * 1000:.2f}ms = "
        f"{plan['ttft']['predicted_s']:.3f}s (SLO {plan['ttft']['slo_s']}s)",
        f"transfer = L kv / BW = {t['bytes'] / 2**30:.2f} GiB / {t['inputs']['link_bytes_per_s'] / 1e9:.1f} GB/s = "
        f"{t['transfer_s'] * 1000:.1f}ms; exposed with layer pipelining {t['exposed_s'] * 1000:.2f}ms; "
        f"overlap holds: {t['pipelining_hides_transfer']}",
        f"fleet link demand = rate L kv = {t['fleet_demand_bytes_per_s'] / 1e9:.2f} GB/s of "
        f"{t['fleet_link_bytes_per_s'] / 1e9:.1f} GB/s -> fits: {t['link_fits']}",
        f"decode batch cap = min(KV {d['kv_batch_bound']:.0f}, TPOT {d['tpot_batch_bound']:.0f}) = "
        f"{d['batch_cap']:.0f}; concurrency C = rate (TTFT + L_out TPOT) = {d['concurrency']:.0f} -> y = {d['workers']}"
        f" (TPOT {d['predicted_tpot_s'] * 1000:.1f}ms)",
        f"disaggregation threshold L_thresh = O_fixed / (t_prefill/token - kv/BW) = "
        f"{_tokens(plan['disaggregation_threshold']['tokens'])}",
    ]
    if "fixed_fleet" in plan:
        f = plan["fixed_fleet"]
        lines.append(f"fixed fleet of {f['workers']}: {f['split']} (headroom {f['headroom']:.2f}, meets SLOs {f['meets_slo']})")
    lines.append(f"{'context':>8} {'link GB/s':>10} {'size GiB':>9} {'transfer ms':>12} {'exposed ms':>11} feasible")
    for row in plan["kv_transfer_table"]:
        lines.append(f"{row['context_tokens']:>8} {row['link_GBps']:>10.1f} {row['bytes'] / 2**30:>9.2f} "
                     f"{row['transfer_s'] * 1000:>12.1f} {row['exposed_s'] * 1000:>11.2f} {row['feasible']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.day:
        return run_day(args)
    missing = [f"--{n.replace('_', '-')}" for n in ("rate", "input_len", "output_len") if getattr(args, n) is None]
    if missing:
        raise SystemExit(f"baton plan: {', '.join(missing)} required (or --day with --workers)")
    plan = build_plan(args)
    print(json.dumps(_json_safe(plan), indent=2) if args.json else render(plan))
    return 0


def run_day(args: argparse.Namespace) -> int:
    from baton.sim.fleet_plan import day_plan, render_day
    from baton.sim.hardware import worker_perf
    from baton.sim.scoring import Slo

    if not args.workers:
        raise SystemExit("baton plan --day: --workers required")
    link = args.link_gbps * 1e9 / 8 if args.link_gbps else None
    perf = worker_perf(args.model, args.gpu, args.gpus_per_worker, link)
    plan = day_plan(perf, args.workers, args.utilisation, Slo(args.ttft_slo, args.tpot_slo), args.hours,
                    args.reshard_s)
    print(json.dumps(plan, indent=2) if args.json else render_day(plan))
    return 0


def _json_safe(value):
    """Infinity is not JSON: an unbounded quantity becomes null."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _tokens(value: float | None) -> str:
    return "never (the wire is slower than local prefill)" if value is None else f"{value:,.0f} tokens"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
