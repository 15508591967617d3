"""Engine vs HF transformers on the same model, and vs llama.cpp on its quantized weights,
side by side in one run.

(a) batch-1 decode tokens/s vs HF `generate`;
(b) aggregate decode tokens/s with 32 concurrent sequences vs HF batch 1;
(c) prefill tokens/s on a 1,024-token prompt vs HF's forward pass, and each one's share of
    the matmul peak measured here (torch.mm, same dtype and threads);
(d) section `llama_cpp`: batch-1 decode on the GGUF's quantized blocks vs llama.cpp on the
    same file, at 1 and 2 threads (bench/quantized_vs_llama_cpp.py; needs
    bench/setup_llama_cpp.sh once).
Runs alternate between the systems and each figure is the median of --runs runs.

    python bench/engine.py                      # bf16 and fp32 vs HF, then vs llama.cpp
    python bench/engine.py --sections llama_cpp --out bench/results/engine_quantized.json
    python bench/engine.py --device cuda --sections hf --out bench/results/engine_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
from machine_info import machine_record

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TARGETS = {"decode_b1_speedup": 1.5, "batch32_vs_hf_b1": 6.0, "prefill_speedup": 1.2}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def matmul_peak(dtype: torch.dtype, device: str, runs: int, reps: int = 10) -> float:
    """Best FLOP/s of torch.mm over the model's own matmul shapes at 1,024 rows."""
    best = 0.0
    for k, n in [(576, 3072), (576, 960), (1536, 576), (2048, 2048)]:
        a = torch.randn(1024, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        for _ in range(3):
            a @ b
        seconds = statistics.median(
            timed(lambda a=a, b=b: [a @ b for _ in range(reps)], device) for _ in range(runs)
        )
        best = max(best, 2 * 1024 * k * n * reps / seconds)
    return best


def prefill_flops(cfg, tokens: int, logits_rows: int) -> float:
    """Matmul FLOPs of one forward pass: projections, attention (causal) and the LM head."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_token_layer = 2 * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    attention_layer = 2 * 2 * q * tokens * (tokens + 1) / 2  # QK^T and PV over the causal half
    return cfg.num_layers * (per_token_layer * tokens + attention_layer) + 2 * h * cfg.vocab_size * logits_rows


def run_dtype(dtype_name: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    from baton.engine import Engine, SamplingParams
    from baton.engine.loader import bundled_model_path

    dtype = getattr(torch, dtype_name)
    path = bundled_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(args.device)
    hf.eval()
    # quantization="none": HF runs the dequantized weights; the quantized path is section (d)
    engine = Engine(dtype=dtype_name, quantization="none", device=args.device, chunk_size=0, max_num_batched_tokens=4096,
                    max_num_seqs=64, kv_cache_memory_gb=1.0)
    cfg = engine.model_config
    rng = random.Random(0)
    short_prompt = engine.tokenizer.encode("The history of the printing press begins")
    n = args.decode_tokens

    def hf_decode():
        ids = torch.tensor([short_prompt], device=args.device)
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    def engine_decode(batch: int):
        # distinct prompts so the prefix cache does not shortcut anything
        prompts = [[rng.randrange(1000, 40000)] + short_prompt for _ in range(batch)]
        engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))

    def random_prompt():
        return [rng.randrange(1000, 40000) for _ in range(args.prefill_tokens)]

    def hf_prefill():
        ids = torch.tensor([random_prompt()], device=args.device)
        with torch.inference_mode():
            hf(ids)

    def engine_prefill():
        engine.generate([random_prompt()], SamplingParams(max_tokens=1))

    for warm in (hf_decode, lambda: engine_decode(1), lambda: engine_decode(args.concurrency), hf_prefill, engine_prefill):
        warm()
    samples = {k: [] for k in ("hf_b1", "engine_b1", "engine_batch", "hf_prefill", "engine_prefill")}
    for _ in range(args.runs):  # alternate so drift hits both sides alike
        samples["hf_b1"].append(n / timed(hf_decode, args.device))
        samples["engine_b1"].append(n / timed(lambda: engine_decode(1), args.device))
        samples["engine_batch"].append(args.concurrency * n / timed(lambda: engine_decode(args.concurrency), args.device))
        samples["hf_prefill"].append(args.prefill_tokens / timed(hf_prefill, args.device))
        samples["engine_prefill"].append(args.prefill_tokens / timed(engine_prefill, args.device))
    med = {k: statistics.median(v) for k, v in samples.items()}
    peak = matmul_peak(dtype, args.device, args.runs)
    t = args.prefill_tokens
    useful = prefill_flops(cfg, t, 1)  # what a server needs: logits of the last token only
    hf_executed = prefill_flops(cfg, t, t)  # HF computes logits for every position
    return {
        "tokens_per_s": {k: round(v, 2) for k, v in med.items()},
        "samples": {k: [round(x, 2) for x in v] for k, v in samples.items()},
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "prefill_share_of_peak": {
            "engine": round(useful * med["engine_prefill"] / t / peak, 3),
            "hf_useful": round(useful * med["hf_prefill"] / t / peak, 3),
            "hf_executed": round(hf_executed * med["hf_prefill"] / t / peak, 3),
        },
        "ratios": {
            "decode_b1_speedup": round(med["engine_b1"] / med["hf_b1"], 2),
            "batch32_vs_hf_b1": round(med["engine_batch"] / med["hf_b1"], 2),
            "prefill_speedup": round(med["engine_prefill"] / med["hf_prefill"], 2),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU (both systems)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--out", default="bench/results/engine.json")
    parser.add_argument("--sections", default="hf,llama_cpp", help="hf (dtypes vs HF), llama_cpp (quantized)")
    parser.add_argument("--llama-threads", default="1,2", help="thread counts of the llama.cpp comparison")
    parser.add_argument("--model", default=None,
                        help="GGUF file of the llama.cpp comparison (default: the bundled model)")
    args = parser.parse_args()
    args.llama_threads = [int(t) for t in args.llama_threads.split(",")]
    sections = set(args.sections.split(","))
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    results = {
        "bench": "engine",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine_record(args.threads if args.device == "cpu" else None), "device": args.device},
        "settings": {k: getattr(args, k) for k in ("runs", "decode_tokens", "concurrency", "prefill_tokens",
                                                  "sections", "llama_threads", "model")},
        "targets": TARGETS,
        "dtypes": {},
    }
    for name in args.dtypes.split(",") if "hf" in sections else ():
        results["dtypes"][name] = r = run_dtype(name, args)
        r["meets_targets"] = {k: r["ratios"][k] >= v for k, v in TARGETS.items()}
        print(name, json.dumps(r["tokens_per_s"]), json.dumps(r["ratios"]), json.dumps(r["prefill_share_of_peak"]), flush=True)
    if "llama_cpp" in sections and args.device == "cpu":
        import quantized_vs_llama_cpp

        results["llama_cpp"] = quantized_vs_llama_cpp.run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
