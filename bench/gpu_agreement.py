"""The engine on a GPU against HF transformers on the same GPU, both on the bundled GGUF:
how often their greedy next tokens agree and the mean KL(HF float32 || engine) over the
held-out passages (teacher forcing, one prefill pass each), and how many tokens a
free-running greedy generation keeps equal to HF's, alone and in one continuous batch.

Each variant is the engine's dtype and quantization: `none` runs the dequantized weights
through torch's matmuls and the Triton kernels; `auto` keeps the GGUF's blocks and runs every
product in the Triton kernel that dequantizes inside the matmul.

    python bench/gpu_agreement.py                       # on cuda; bench/gpu_check.sh runs it
    python bench/gpu_agreement.py --device cpu --variants float32:none --generate-tokens 8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine_info import machine_record
from quant_quality import passages

# float32 through the same weights should agree with HF almost everywhere; anything with
# bf16 activations or the quantized blocks is held to the quantized path's target.
TARGETS = {"float32:none": 0.99}
DEFAULT_TARGET = 0.97


def hf_reference(device: str):
    from transformers import AutoModelForCausalLM

    from baton.engine.loader import bundled_model_path

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.to(device).eval()


def hf_greedy(hf, prompt: list[int], tokens: int, device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def equal_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_variant(engine, texts: dict, reference: dict, hf_tokens: dict, generate_tokens: int) -> dict:
    from baton.engine import SamplingParams
    from baton.engine.scoring import prompt_logits

    params = SamplingParams(max_tokens=generate_tokens, ignore_eos=True)
    prompts = {name: ids[:16] for name, ids in texts.items()}
    batched = dict(zip(prompts, (o.token_ids for o in engine.generate(list(prompts.values()), params))))
    per_text, agree_total, kl_total, count = {}, 0, 0.0, 0
    for name, ids in texts.items():
        expected, got = reference[name], prompt_logits(engine, ids)
        agree = int((expected.argmax(-1) == got.argmax(-1)).sum())
        kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(expected, -1), log_target=True,
                      reduction="none").sum(-1)
        alone = engine.generate([prompts[name]], params)[0].token_ids
        per_text[name] = {"tokens": len(ids), "greedy_agreement": round(agree / len(ids), 4),
                          "mean_kl": float(kl.mean()),
                          "free_running_equal_to_hf": equal_prefix(alone, hf_tokens[name]),
                          "batched_equal_to_alone": equal_prefix(batched[name], alone)}
        agree_total, kl_total, count = agree_total + agree, kl_total + float(kl.sum()), count + len(ids)
        print(f"  {name:24s} {len(ids):5d} tokens  agreement {agree / len(ids):.4f}  mean KL {kl.mean():.2e}"
              f"  free-running = HF for {per_text[name]['free_running_equal_to_hf']}/{generate_tokens}"
              f"  batched = alone for {per_text[name]['batched_equal_to_alone']}/{generate_tokens}", flush=True)
    return {"tokens": count, "greedy_agreement": round(agree_total / count, 4), "mean_kl": kl_total / count,
            "per_text": per_text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", default="float32:none,bfloat16:none,float32:auto,bfloat16:auto",
                        help="comma-separated dtype:quantization pairs")
    parser.add_argument("--window", type=int, default=512, help="tokens per licence window")
    parser.add_argument("--generate-tokens", type=int, default=32)
    parser.add_argument("--out", default="bench/results/gpu_agreement.json")
    args = parser.parse_args()
    from baton.engine import Engine

    hf = hf_reference(args.device)
    texts = None
    results = {"bench": "gpu_agreement", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": {**machine_record(), "device": args.device,
                           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None},
               "reference": "HF transformers, float32, on the same device", "variants": {}}
    for variant in args.variants.split(","):
        dtype, quantization = variant.split(":")
        engine = Engine(dtype=dtype, quantization=quantization, device=args.device, kv_cache_memory_gb=0.5,
                        chunk_size=0, max_num_seqs=16)
        if texts is None:  # the reference's logits and generations, once
            texts = passages(engine.tokenizer, args.window)
            with torch.inference_mode():
                reference = {name: hf(torch.tensor([ids], device=args.device)).logits[0].float().cpu()
                             for name, ids in texts.items()}
            hf_tokens = {name: hf_greedy(hf, ids[:16], args.generate_tokens, args.device)
                         for name, ids in texts.items()}
            results["sources"] = sorted(texts)
        print(f"{variant} (kernels: {engine.runner.ops.backend}; quantization: {engine.runner.quantization}):",
              flush=True)
        r = check_variant(engine, texts, reference, hf_tokens, args.generate_tokens)
        target = TARGETS.get(variant, DEFAULT_TARGET)
        r.update(target_agreement=target, meets_target=r["greedy_agreement"] >= target,
                 kernels=engine.runner.ops.backend, quantization=engine.runner.quantization)
        results["variants"][variant] = r
        print(f"  all: {r['tokens']} tokens, agreement {r['greedy_agreement']:.4f} (target {target}), "
              f"mean KL {r['mean_kl']:.2e}", flush=True)
        del engine
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
