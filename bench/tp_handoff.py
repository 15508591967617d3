"""KV handoffs between tensor-parallel groups: is the transfer still layer-wise?

A prefill worker of A ranks hands a prompt's KV to a decode worker of B ranks, for A and B
in {1, 3} on SmolLM2 (3 KV heads: at 3 ranks each rank sends or receives one head, from or
to the ranks that hold it), or in {1, 2, 4} on the tests' tiny Llama layout (`--model tiny`:
8 query and 4 KV heads, random weights, here with SmolLM2's 30 layers so that the transfer
has as many layers to overlap as the real model). For each pair and prompt length it
measures the exposed transfer (the last rank's ACK minus the end of the prefill: what the
handoff adds to TTFT) and checks it against the KV bench's limit, 2 x (back-to-back transfer
/ layers) + 5 ms, where the back-to-back transfer of the same bytes into the one-rank decode
worker is measured in the same run (bench/kv.py's method). Prefill workers run on core 0,
decode workers on core 1, all of a worker's ranks on its core, as bench/kv.py places its
workers.

    .venv/bin/python bench/tp_handoff.py [--model tiny] [--repeats 3] [--lengths 512,2048] [--transport shm]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))
from kv import VOCAB_RANGE, Worker, exposed_limit, handoff_once, stop_all, stream_once  # noqa: E402
from machine_info import machine_record  # noqa: E402

MODELS = {  # name: (tensor-parallel sizes, description)
    "smollm2": ((1, 3), "SmolLM2-135M (bundled), float32"),
    "tiny": ((1, 2, 4), "tiny Llama layout (8 query / 4 KV heads, head_dim 16, random weights), "
                        "30 layers, 4,096 positions, 40,000 tokens, float32"),
}


def tiny_model(folder: Path) -> list[str]:
    from tests.engine.tiny_llama import write_tiny_llama

    # 4 KV heads of 16 over 30 layers: 15 KiB of fp32 KV per token, a third of SmolLM2's;
    # a vocabulary that holds the KV bench's random prompt ids
    write_tiny_llama(folder, num_hidden_layers=30, max_position_embeddings=4096, vocab_size=VOCAB_RANGE[1])
    return ["--model", str(folder)]


def measure_pair(prefill: Worker, decode: Worker, length: int, repeats: int, rng: random.Random) -> dict:
    runs = [handoff_once(prefill, decode, length, rng, f"{prefill.name}-{decode.name}-{length}-{i}")
            for i in range(repeats)]
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    return {"bytes": runs[0]["bytes"], "layers": runs[0]["layers"], "prefill_seconds": med("prefill_seconds"),
            "transfer_seconds": med("transfer_seconds"), "exposed_seconds": med("exposed_seconds"),
            "overlapped_layers": statistics.median(r["overlapped_layers"] for r in runs), "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bulk-repeats", type=int, default=5)
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    parser.add_argument("--out", default=None, help="default: bench/results/tp_handoff[_tiny][_shm].json")
    args = parser.parse_args()
    suffix = ("" if args.model == "smollm2" else f"_{args.model}") + ("" if args.transport == "tcp" else f"_{args.transport}")
    sizes, description = MODELS[args.model]
    out = Path(args.out or Path(__file__).parent / "results" / f"tp_handoff{suffix}.json")

    load_at_start = os.getloadavg()
    model = tiny_model(Path(tempfile.mkdtemp(prefix="tp-handoff-tiny-"))) if args.model == "tiny" else []
    common = [*model, "--dtype", "float32", "--quantization", "none", "--block-size", "16", "--kv-cache-memory-gb", "0.5"]
    prefill_args = [*common, "--chunk-size", "0", "--max-num-batched-tokens", "8192"]
    prefills = {a: Worker(f"prefill-tp{a}", "prefill", 0, [*prefill_args, "--tensor-parallel-size", str(a)])
                for a in sizes}
    decodes = {b: Worker(f"decode-tp{b}", "decode", 1,
                         [*common, "--kv-transport", args.transport, "--tensor-parallel-size", str(b)])
               for b in sizes}
    workers = [*prefills.values(), *decodes.values()]
    stream_state: dict = {}
    try:
        deadline = time.monotonic() + 600
        for w in workers:
            w.wait_ready(deadline)
        rng = random.Random(0)
        for a in sizes:  # connections, allocators, caches on every route
            for b in sizes:
                handoff_once(prefills[a], decodes[b], 64, rng, f"warmup-{a}-{b}")
        stream_once(decodes[1], 64, rng, "warmup-stream", stream_state)
        results = []
        for length in [int(x) for x in args.lengths.split(",")]:
            bulk = [stream_once(decodes[1], length, rng, f"bulk-{length}-{i}", stream_state)["seconds"]
                    for i in range(args.bulk_repeats)]
            for a in sizes:
                for b in sizes:
                    row = measure_pair(prefills[a], decodes[b], length, args.repeats, rng)
                    limit = exposed_limit(statistics.median(bulk), row["layers"])
                    row.update(prompt_tokens=length, prefill_tp=a, decode_tp=b, bulk_transfer_seconds=statistics.median(bulk),
                               bulk_runs=bulk, exposed_limit_seconds=limit, meets_exposed_target=row["exposed_seconds"] <= limit)
                    results.append(row)
                    print(json.dumps({k: v for k, v in row.items() if not k.endswith("runs")}), flush=True)
        doc = {
            "benchmark": "tp_kv_handoff",
            "model": description,
            "transport": args.transport,
            "repeats": args.repeats,
            "machine": machine_record(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
            "notes": "medians over repeats; exposed = last ACK (every rank's routes) minus the end of the "
                     "prefill on rank 0; the limit is bench/kv.py's, from back-to-back transfers of the same "
                     "bytes into the one-rank decode worker in this run",
            "results": results,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}")
    finally:
        stop_all(workers, stream_state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
