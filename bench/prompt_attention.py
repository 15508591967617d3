"""Prompt attention on each CPU path, by chunk and context: torch's (its flash attention, in
float32 and in bf16) against the native kernel (native/prompt_attention.h, float32 products
and, with AVX512-BF16, bf16 ones on VDPBF16PS and, with AMX, on tiles), on SmolLM2's heads (9 query, 3 KV, size 64), the KV cache
in bf16 as `auto` keeps it. Each cell is one layer's attention, best of `--repeats`, the
paths taking turns so drift hits each alike. This is what native/prompt_attention.py's
`choose` is decided from, per CPU vendor. `--layers N` gives each cell N caches of its own,
read in turn as a step's layers read theirs (a cell is then per layer, its caches cold as in
a step); `--shapes` times other chunks (a few rows late in a long prompt: the native step's
chunks beside decodes, whose context is laid out afresh each step).

    python bench/prompt_attention.py --threads 1    # writes bench/results/prompt_attention.json
    python bench/prompt_attention.py --layers 30 --shapes 13x1013 13x1513 45x1545 --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

RESULTS = Path(__file__).with_name("results")
# (new rows, context): a serving prompt whole, chunks of a long prompt early and late, an extend
SHAPES = ((256, 256), (512, 512), (512, 2000), (64, 2000), (1024, 1024))


def shape(text: str) -> tuple[int, int]:
    rows, _, ctx = text.partition("x")
    if not (rows.isdigit() and ctx.isdigit() and 0 < int(rows) <= int(ctx)):
        raise argparse.ArgumentTypeError(f"a shape is ROWSxCONTEXT with 0 < ROWS <= CONTEXT, not {text!r}")
    return int(rows), int(ctx)


def paged_path(native, lib, engine: str):
    """The kernel reading the context through the block table (native.attend_paged), in the
    torch op's signature; the torch op gathers the context into one tensor first."""

    def attend(q, k, v, k_cache, v_cache, table, cu_seqlens_q, context_lens, scale):
        return native.attend_paged(lib, q, k_cache, v_cache, table[0], context_lens[0], scale, True, engine)

    return attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "prompt_attention.json")
    parser.add_argument("--layers", type=int, default=1, help="caches a cell reads in turn (each cold)")
    parser.add_argument("--shapes", nargs="+", metavar="ROWSxCONTEXT", type=shape, default=SHAPES)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before the native library's OpenMP starts

    import torch
    from machine_info import machine_record

    from baton.engine.kernels import compute_prompt_attention_in, ref
    from baton.engine.native import build
    from baton.engine.native import prompt_attention as native

    torch.set_num_threads(args.threads)
    lib = build.load()
    heads, kv_heads, dim, block = 9, 3, 64, 16
    unsupported = native.supported(lib, heads, kv_heads, dim, torch.bfloat16)
    # float32 activations, as `auto` runs them on quantized weights; torch's bf16 path casts
    # in and out as the engine's (kernels.compute_prompt_attention_in)
    in_bf16 = SimpleNamespace(paged_prefill_attention=ref.paged_prefill_attention)
    compute_prompt_attention_in(in_bf16, torch.bfloat16)
    paths = {"torch_fp32": ref.paged_prefill_attention, "torch_bf16": in_bf16.paged_prefill_attention}
    if unsupported is None:
        paths["native_fp32"] = native.paged_prefill_attention_op(lib, False)
        for engine in ("avx512", "amx"):  # VDPBF16PS, and AMX tiles where the CPU has them
            if native.takes_bf16(lib, engine):
                paths[f"native_bf16_{engine}"] = native.paged_prefill_attention_op(lib, True, engine)
                # the block table read as the native step reads it
                paths[f"native_bf16_{engine}_paged"] = paged_path(native, lib, engine)

    table: dict[str, dict[str, float]] = {name: {} for name in paths}
    for rows, ctx in args.shapes:
        blocks = -(-ctx // block)
        caches = [(torch.randn(blocks, block, kv_heads, dim).bfloat16(), torch.randn(blocks, block, kv_heads, dim).bfloat16())
                  for _ in range(args.layers)]
        table_row = torch.randperm(blocks, dtype=torch.int32)[None]
        q = torch.randn(rows, heads, dim)
        flat = [(ref.gather_context(k_cache, table_row[0], ctx)[ctx - rows:].float(),
                 ref.gather_context(v_cache, table_row[0], ctx)[ctx - rows:].float()) for k_cache, v_cache in caches]
        best = {name: float("inf") for name in paths}
        for _ in range(args.repeats):
            for name, attend in paths.items():
                start = time.perf_counter()
                for (k_cache, v_cache), (flat_k, flat_v) in zip(caches, flat):
                    attend(q, flat_k, flat_v, k_cache, v_cache, table_row, [0, rows], [ctx], dim ** -0.5)
                best[name] = min(best[name], (time.perf_counter() - start) / args.layers)
        key = f"{rows}x{ctx}"
        for name in paths:
            table[name][key] = round(best[name] * 1e3, 3)
        print(f"{key:>10}: " + "  ".join(f"{n} {table[n][key]:7.2f} ms" for n in paths), flush=True)

    result = {"machine": machine_record(args.threads), "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
              "kv_cache_dtype": "bfloat16", "repeats": args.repeats, "layers": args.layers, "native_unsupported": unsupported,
              "ms_per_layer_best": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
