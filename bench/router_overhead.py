"""Router overhead: TTFT through the router minus TTFT straight from the decode worker.

One colocated worker and the router on this machine (`baton up`'s runtime). At low load
(one request at a time), pairs of fresh prompts of equal length go once to the worker's
internal /generate and once through the router's /v1/completions, in alternating order;
the result is the p50 of the router's TTFT minus the p50 of the direct TTFT (target
<= 3 ms), plus the median of the per-pair differences.

    python bench/router_overhead.py --pairs 60 --json-out bench/results/router_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import httpx
from machine_info import machine_record

from baton.local.runtime import LocalStack, StackSpec


def _event(line: str) -> dict:
    if not line.startswith("data:") or line.endswith("[DONE]"):
        return {}
    return json.loads(line[5:])


def ttft_direct(http: httpx.Client, url: str, token: str, prompt: list[int], rid: str) -> float:
    body = {"request_id": rid, "prompt_token_ids": prompt,
            "params": {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}}
    started = time.perf_counter()
    with http.stream("POST", f"{url}/internal/generate", json=body,
                     headers={"Authorization": f"Bearer {token}"}) as response:
        response.raise_for_status()
        first = None
        for line in response.iter_lines():
            if first is None and _event(line).get("token_ids"):
                first = time.perf_counter() - started
    return first


def ttft_router(http: httpx.Client, url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started = time.perf_counter()
    first = None
    with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and any(c.get("text") for c in _event(line).get("choices", [])):
                first = time.perf_counter() - started
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json-out", default="bench/results/router_overhead.json")
    args = parser.parse_args()
    rng = random.Random(0)
    stack = LocalStack(StackSpec(colocated=1, port=0)).start()
    try:
        worker = stack.workers[0].url
        with httpx.Client(timeout=120) as http:
            model = http.get(f"{stack.url}/v1/models").json()["data"][0]["id"]
            direct, routed = [], []
            for i in range(args.warmup + args.pairs):
                prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(2)]
                order = [("direct", prompts[0]), ("router", prompts[1])]
                if i % 2:
                    order.reverse()
                sample = {}
                for kind, prompt in order:
                    if kind == "direct":
                        sample[kind] = ttft_direct(http, worker, stack.token, prompt, f"overhead-{i}")
                    else:
                        sample[kind] = ttft_router(http, stack.url, model, prompt)
                if i >= args.warmup:
                    direct.append(sample["direct"])
                    routed.append(sample["router"])
    finally:
        stack.stop()
    ms = lambda xs: [1e3 * x for x in xs]
    result = {
        "pairs": args.pairs, "prompt_len": args.prompt_len,
        "direct_ttft_p50_ms": statistics.median(ms(direct)),
        "router_ttft_p50_ms": statistics.median(ms(routed)),
        "overhead_p50_ms": statistics.median(ms(routed)) - statistics.median(ms(direct)),
        "paired_overhead_median_ms": statistics.median(ms([r - d for r, d in zip(routed, direct)])),
        "target_ms": 3.0,
        "load_average_1m_5m_15m": os.getloadavg(),  # absolute times are noise on a busy machine
        "machine": machine_record(),
        "direct_ttft_ms": ms(direct), "router_ttft_ms": ms(routed),
    }
    result["meets_target"] = result["overhead_p50_ms"] <= 3.0
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))


if __name__ == "__main__":
    main()
