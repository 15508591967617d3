"""The first generated tokens after fresh prompts and their log-probabilities, on the bundled
model at one dtype and quantization: a prompt step's sampled row is the only row whose
logits count, so a change to how that row is computed shows here, and two builds (or a
build and the float32 reference, `--dtype float32 --quantization none`) compare token by
token. Random prompts of each length (seeded), greedy, whole and in chunks.

    python bench/first_tokens.py --out /tmp/a.json                              # auto, as served
    python bench/first_tokens.py --dtype float32 --quantization none --out /tmp/reference.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from machine_info import machine_record

from baton.engine import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 40, 9])
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[0, 32], help="0: whole prompts")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {}
    for chunk in args.chunk_sizes:
        engine = Engine(dtype=args.dtype, quantization=args.quantization, kv_cache_memory_gb=0.25,
                        threads=args.threads, chunk_size=chunk)
        for length in args.lengths:
            ids = torch.randint(100, 20000, (length,), generator=torch.Generator().manual_seed(length)).tolist()
            out = engine.generate([ids], SamplingParams(max_tokens=args.tokens, temperature=0.0, logprobs=3))[0]
            results[f"chunk{chunk}_prompt{length}"] = [
                {"token_id": step["token_id"], "logprob": step["logprob"], "top_logprobs": step["top_logprobs"]}
                for step in out.logprobs]
    report = {"bench": "first_tokens", "dtype": args.dtype, "quantization": args.quantization,
              "machine": machine_record(args.threads), "prompts": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, steps in results.items():
        print(name, [(s["token_id"], round(s["logprob"], 4)) for s in steps])


if __name__ == "__main__":
    main()
