"""The native decode attention alone, at a decode step's shape on the bundled model (30
layers, 9 query heads on 3 KV heads of 64, a bf16 cache in blocks of 16 scattered over the
pool). Each layer has its own cache, as in the engine, so a step reads its rows from memory
("distinct caches"); "one cache" runs every layer on the first, its rows already in cache:
the attention's own arithmetic. Each figure is the best of `--repeats` passes over all layers.

    python bench/decode_attention.py --threads 1   # writes bench/results/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("results")
LAYERS, QUERY_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="decode rows a step")
    parser.add_argument("--context", type=int, default=300, help="tokens each row attends over")
    parser.add_argument("--pool-blocks", type=int, default=4000, help="KV blocks in each layer's cache")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_attention.json")
    args = parser.parse_args()
    if min(args.rows) < 1 or args.context < 1:
        parser.error(f"--rows and --context must be at least 1, got {args.rows} and {args.context}")
    if max(args.rows) * -(-args.context // BLOCK) > args.pool_blocks:
        parser.error(f"{max(args.rows)} rows of {args.context} tokens need more than --pool-blocks {args.pool_blocks}")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before the native library's OpenMP starts

    import torch
    from machine_info import machine_record

    from baton.engine.native import build
    from baton.engine.native import decode_attention as native

    torch.set_num_threads(args.threads)
    lib = build.load()
    if lib is None:
        raise SystemExit(f"the native library is unavailable: {build.failure()}")
    attend = native.paged_decode_attention_op(lib)
    generator = torch.Generator().manual_seed(0)
    shape = (args.pool_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=generator).bfloat16(), torch.randn(shape, generator=generator).bfloat16())
              for _ in range(LAYERS)]
    per_row = -(-args.context // BLOCK)
    order = torch.randperm(args.pool_blocks, generator=generator).to(torch.int32)
    scale = HEAD_DIM ** -0.5

    def timed(layer_caches, q, tables, lens) -> float:
        start = time.perf_counter()
        for k, v in layer_caches:
            attend(q, k, v, tables, lens, scale)
        return time.perf_counter() - start

    rows_out = []
    for rows in args.rows:
        step = (torch.randn(rows, QUERY_HEADS, HEAD_DIM, generator=generator),
                order[: rows * per_row].view(rows, per_row).contiguous(),
                torch.full((rows,), args.context, dtype=torch.int32))
        distinct = min(timed(caches, *step) for _ in range(args.repeats))
        one = min(timed([caches[0]] * LAYERS, *step) for _ in range(args.repeats))
        row = {"rows": rows, "context": args.context, "distinct_caches_ms": round(distinct * 1e3, 2),
               "one_cache_ms": round(one * 1e3, 2)}
        print(row, flush=True)
        rows_out.append(row)
    record = {"machine": machine_record(), "threads": args.threads, "layers": LAYERS, "query_heads": QUERY_HEADS,
              "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "kv_dtype": "bfloat16", "block_size": BLOCK,
              "pool_blocks": args.pool_blocks, "cases": rows_out}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
