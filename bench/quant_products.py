"""The bundled model's quantized products on each CPU path, by input rows.

Every quantized matrix of SmolLM2 (the GGUF's own blocks) multiplied by `rows` random
input rows on each path this machine has: the int16 kernels (decode's), the bf16 products
dequantized inside the product (AVX512-BF16, AMX), and the dense path (the matrix
dequantized in tiles, then torch's GEMM in bf16 or fp32). Each cell is the whole model's
products for one step, best of `--repeats`, the paths taking turns so drift hits each
alike. This is what quant/placement.py's row thresholds are chosen from.

    python bench/quant_products.py --threads 1       # writes bench/results/quant_products.json
    python bench/quant_products.py --model FILE.gguf --rows 1 8 16   # another file's matrices
    python bench/quant_products.py --layers-only    # without the output head: a step's own
                                                    # products (it runs the head on sampled rows)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("results")
ROWS = (8, 16, 24, 32, 48, 64, 128, 256, 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="GGUF file (default: the bundled model)")
    parser.add_argument("--layers-only", action="store_true",
                        help="leave out the output head (a step multiplies only its sampled rows by it)")
    parser.add_argument("--out", type=Path, default=RESULTS / "quant_products.json")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before the native library's OpenMP starts

    import torch
    from machine_info import machine_record

    from baton.engine import Engine
    from baton.engine.native import quant as native_quant
    from baton.engine.quant.placement import quantized_weights
    from baton.engine.quant.weight import DenseProducts

    torch.set_num_threads(args.threads)
    engine = Engine(args.model, dtype="float32", quantization="auto", device="cpu", chunk_size=0, max_num_seqs=8,
                    kv_cache_memory_gb=0.25)
    weights = quantized_weights(engine.runner.model)
    if args.layers_only:
        weights = [w for w in weights if w is not engine.runner.model.lm_head]
    lib = weights[0]._lib
    if lib is None:
        sys.exit("the native library is not loaded: nothing to measure")

    def dense(dtype):
        def run(w, x):
            saved, w.dense = w.dense, DenseProducts(dtype, 1)
            try:
                return w._dense_linear(x)
            finally:
                w.dense = saved
        return run

    paths = {"int16": lambda w, x: native_quant.product(lib, w.native_matrix, x, w.shape[0])}
    for name in native_quant.panel_engines(lib):
        paths[name] = lambda w, x, name=name: native_quant.product_panels(lib, w.native_matrix, x, w.shape[0], name)
    paths["dense_bf16"] = dense(torch.bfloat16)
    paths["dense_fp32"] = dense(torch.float32)

    table: dict[str, dict[int, float]] = {name: {} for name in paths}
    for rows in args.rows:
        inputs = {w.k: torch.randn(rows, w.k) for w in weights}
        best = {name: float("inf") for name in paths}
        for _ in range(args.repeats):
            for name, run in paths.items():
                start = time.perf_counter()
                for w in weights:
                    run(w, inputs[w.k])
                best[name] = min(best[name], time.perf_counter() - start)
        for name in paths:
            table[name][rows] = round(best[name] * 1e3, 2)
        print(f"{rows:4d} rows: " + "  ".join(f"{n} {table[n][rows]:7.1f} ms" for n in paths), flush=True)

    result = {"machine": machine_record(args.threads), "model": engine.model_name,
              "matrices": len(weights), "layers_only": args.layers_only, "weights": sum(w.shape[0] * w.shape[1] for w in weights),
              "formats": sorted({w.describe() for w in weights}), "weight_bytes": sum(w.nbytes for w in weights),
              "repeats": args.repeats, "ms_per_step_best": table,
              "int16_kernel": native_quant.kernel_name(lib), "panel_engines": native_quant.panel_engines(lib)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
