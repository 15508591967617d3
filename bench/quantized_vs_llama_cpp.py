"""Batch-1 decode on quantized weights: Baton (`quantization="auto"`) against llama.cpp on
the same GGUF file at the same thread counts, side by side in one run (bench/engine.py's
`llama_cpp` section).

llama.cpp runs in its own venv (bench/setup_llama_cpp.sh) behind bench/llama_cpp_peer.py,
both through llama-cpp-python's `generate` and through llama.cpp's C API alone (a
llama_decode loop: no Python wrapper's per-token work); the target is met against the
faster of the two. Runs alternate between the systems, and each figure is the median of
--runs runs of `--decode-tokens` greedy tokens after a short prompt, prefill included on
every side. Baton is timed through `Engine.generate`, its scheduler and sampler included.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

PEER_PYTHON = Path(__file__).parent / ".venv-llama-cpp" / "bin" / "python"
PEER_SCRIPT = Path(__file__).with_name("llama_cpp_peer.py")
PROMPT = "The history of the printing press begins"
TARGET = 1.2  # Baton's tokens/s over llama.cpp's, at each thread count


class LlamaCppPeer:
    def __init__(self, model_path: Path):
        if not PEER_PYTHON.exists():
            raise FileNotFoundError(f"{PEER_PYTHON} is missing: run bench/setup_llama_cpp.sh first")
        self.process = subprocess.Popen([str(PEER_PYTHON), str(PEER_SCRIPT), str(model_path)], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp peer exited (code {self.process.poll()})")
        return json.loads(line)

    def decode(self, threads: int, tokens: int, mode: str) -> dict:
        request = {"threads": threads, "prompt": PROMPT, "tokens": tokens, "mode": mode}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def run(args) -> dict:
    from baton.engine import Engine, SamplingParams
    from baton.engine.loader import bundled_model_path

    path = Path(args.model) if args.model else bundled_model_path()
    engine = Engine(model=str(path), dtype="float32", quantization="auto", device="cpu", chunk_size=0,
                    max_num_seqs=8, kv_cache_memory_gb=0.25)
    prompt = engine.tokenizer.encode(PROMPT)
    n = args.decode_tokens
    params = SamplingParams(max_tokens=n, ignore_eos=True)

    def baton(threads: int) -> tuple[float, list[int]]:
        torch.set_num_threads(threads)  # the native kernels share torch's OpenMP threads
        start = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        return time.perf_counter() - start, out.token_ids

    peer = LlamaCppPeer(path)
    built_with = PEER_PYTHON.parent.parent / ".built-with"  # written by bench/setup_llama_cpp.sh
    peer.info["built_with"] = built_with.read_text().strip() if built_with.exists() else "unknown"
    result = {"model_file": path.name, "prompt": PROMPT, "decode_tokens": n, "target_ratio": TARGET,
              "baton": {"quantization": engine.runner.quantization, "prompt_tokens": len(prompt)},
              "llama_cpp": dict(peer.info), "threads": {}}
    modes = {"llama_cpp_generate": "generate", "llama_cpp_decode_loop": "decode_loop"}
    try:
        for threads in args.llama_threads:
            for _ in range(2):  # warm every side
                baton(threads)
                for mode in modes.values():
                    peer.decode(threads, n, mode)
            samples = {"baton": [], **{name: [] for name in modes}}
            for _ in range(args.runs):
                seconds, baton_ids = baton(threads)
                samples["baton"].append(n / seconds)
                for name, mode in modes.items():
                    answer = peer.decode(threads, n, mode)
                    samples[name].append(n / answer["seconds"])
            med = {k: statistics.median(v) for k, v in samples.items()}
            fastest_peer = max(med[name] for name in modes)
            same = next((i for i, (a, b) in enumerate(zip(baton_ids, answer["token_ids"])) if a != b),
                        min(len(baton_ids), len(answer["token_ids"])))
            result["llama_cpp"]["prompt_tokens"] = answer["prompt_tokens"]
            record = result["threads"][str(threads)] = {
                "tokens_per_s": {k: round(v, 1) for k, v in med.items()},
                "samples": {k: [round(x, 1) for x in v] for k, v in samples.items()},
                "ratio_vs_generate": round(med["baton"] / med["llama_cpp_generate"], 2),
                "ratio_vs_decode_loop": round(med["baton"] / med["llama_cpp_decode_loop"], 2),
                "meets_target": med["baton"] / fastest_peer >= TARGET,
                "greedy_tokens_equal_before_first_difference": same,
            }
            print(f"baton vs llama.cpp, {threads} thread(s):", json.dumps(record["tokens_per_s"]),
                  "ratios", record["ratio_vs_generate"], record["ratio_vs_decode_loop"], flush=True)
    finally:
        peer.close()
    return result
