"""How close serving the GGUF's quantized blocks (`quantization="auto"`) stays to the
float32 path (`quantization="none"`: the same blocks dequantized once, float32 throughout),
on held-out text: no prompt used while building or tuning the kernels.

For every passage, teacher forcing: at each position both paths see the same prefix, and
we count how often their greedy next tokens agree and the mean KL(float32 || quantized) of
their next-token distributions. Free-running greedy generations from each passage's start
are compared too (how many tokens match before the first difference). Target: agreement
>= 97% of tokens.

    python bench/quant_quality.py     # the quantized path at auto (the default), float32, bfloat16
    python bench/quant_quality.py --dtypes auto --hide-flags avx512_bf16,amx_bf16
                                      # auto as on this CPU without its bf16 instructions
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine_info import machine_record

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HELD_OUT = Path(__file__).with_name("data") / "held_out.md"
LICENSE = Path("/usr/share/common-licenses/Apache-2.0")  # where the system has it
TARGET_AGREEMENT = 0.97


def passages(tokenizer, window: int) -> dict[str, list[int]]:
    """name -> token ids: held_out.md's sections, the Zen of Python, and (if present) the
    Apache-2.0 licence text in windows of `window` tokens."""
    out = {}
    for section in HELD_OUT.read_text().split("## ")[1:]:
        title, _, body = section.partition("\n")
        out[title.strip().lower()] = tokenizer.encode(body.strip())
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    out["zen of python"] = tokenizer.encode(codecs.decode(this.s, "rot13"))
    if LICENSE.exists():
        ids = tokenizer.encode(LICENSE.read_text())
        for i in range(min(4, len(ids) // window)):
            out[f"apache-2.0 licence {i}"] = ids[i * window : (i + 1) * window]
    return out


def compare(reference, quantized, texts: dict[str, list[int]], generate_tokens: int) -> dict:
    from baton.engine import SamplingParams
    from baton.engine.scoring import prompt_logits

    per_text, agree_total, kl_total, count = {}, 0, 0.0, 0
    for name, ids in texts.items():
        expected, got = prompt_logits(reference, ids), prompt_logits(quantized, ids)
        agree = int((expected.argmax(-1) == got.argmax(-1)).sum())
        kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(expected, -1), log_target=True,
                      reduction="none").sum(-1)
        prompt = ids[:16]
        params = SamplingParams(max_tokens=generate_tokens, ignore_eos=True)
        a, b = (e.generate([prompt], params)[0].token_ids for e in (reference, quantized))
        first_difference = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        per_text[name] = {"tokens": len(ids), "greedy_agreement": round(agree / len(ids), 4),
                          "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
                          "free_running_tokens_equal_before_first_difference": first_difference}
        agree_total += agree
        kl_total += float(kl.sum())
        count += len(ids)
        print(f"  {name:24s} {len(ids):5d} tokens  agreement {agree / len(ids):.4f}  mean KL {kl.mean():.2e}"
              f"  free-running equal for {first_difference}/{generate_tokens}", flush=True)
    agreement = agree_total / count
    return {"tokens": count, "greedy_agreement": round(agreement, 4), "mean_kl": kl_total / count,
            "meets_target": agreement >= TARGET_AGREEMENT, "per_text": per_text}


def hide_cpu_flags(names: list[str]) -> None:
    """Make the engine's CPU detection (cpu_features.this_cpu) miss `names`, as on a CPU of
    this kind without them: every choice made from the flags follows. The instructions stay
    compiled into the native library; only what the engine chooses changes."""
    from baton.engine import cpu_features

    real = cpu_features.Path

    class Filtered:
        def __init__(self, path):
            self.path = real(path)

        def read_text(self):
            lines = self.path.read_text().splitlines()
            return "\n".join(" ".join(w for w in line.split(" ") if w not in names) if line.startswith("flags")
                             else line for line in lines)

    cpu_features.Path = Filtered
    cpu_features.this_cpu.cache_clear()
    left = cpu_features.this_cpu().flags
    assert not left & set(names), f"{sorted(left & set(names))} still seen"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="auto,float32,bfloat16",
                        help="dtypes of the quantized path (auto: what the engine runs by default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=512, help="tokens per licence window")
    parser.add_argument("--generate-tokens", type=int, default=48)
    parser.add_argument("--hide-flags", default="",
                        help="comma-separated CPU flags the engine is not to see (e.g. avx512_bf16,amx_bf16)")
    parser.add_argument("--model", default=None,
                        help="GGUF file (default: the bundled model); its float32 reference is the same file dequantized")
    parser.add_argument("--out", default="bench/results/quant_quality.json")
    args = parser.parse_args()
    hidden = [f for f in args.hide_flags.split(",") if f]
    if hidden:
        hide_cpu_flags(hidden)
    from baton.engine import Engine

    torch.set_num_threads(args.threads)
    settings = dict(model=args.model, device="cpu", kv_cache_memory_gb=0.25, threads=args.threads, chunk_size=0)
    reference = Engine(dtype="float32", quantization="none", **settings)
    texts = passages(reference.tokenizer, args.window)
    results = {"bench": "quant_quality", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": machine_record(args.threads), "model": args.model or "bundled", "reference": "quantization=none, float32",
               "target_agreement": TARGET_AGREEMENT, "sources": sorted(texts), "hidden_cpu_flags": hidden,
               "quantized": {}}
    for dtype in args.dtypes.split(","):
        quantized = Engine(dtype=dtype, quantization="auto", **settings)
        print(f"quantization=auto, {dtype} ({quantized.runner.quantization}):", flush=True)
        r = results["quantized"][dtype] = {"kernels": quantized.runner.quantization,
                                           **compare(reference, quantized, texts, args.generate_tokens)}
        print(f"  all: {r['tokens']} tokens, agreement {r['greedy_agreement']:.4f}, mean KL {r['mean_kl']:.2e}",
              flush=True)
        del quantized
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
