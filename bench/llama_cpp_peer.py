"""llama.cpp's side of bench/engine.py, run by its own venv's python (bench/setup_llama_cpp.sh):
one JSON request a line on stdin, one JSON answer a line on stdout.

    {"threads": 2, "prompt": "...", "tokens": 64, "mode": "generate"}
        ->  {"seconds": 0.41, "token_ids": [...], "prompt_tokens": 7}

Greedy decoding of `tokens` tokens after the prompt, timed from the call to the last token
(the prompt's prefill included, as Baton's side times it), in one of two modes:
- generate: llama-cpp-python's `Llama.generate`, the API a Python user calls;
- decode_loop: llama.cpp's C API alone (llama_decode of one token, then the logits' argmax),
  without that wrapper's per-token work: llama.cpp's own speed.
One model per thread count.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp
import numpy as np


def generate(llm: llama_cpp.Llama, prompt: list[int], wanted: int) -> list[int]:
    ids = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        ids.append(token)
        if len(ids) == wanted:
            break
    return ids


def decode_loop(llm: llama_cpp.Llama, prompt: list[int], wanted: int) -> list[int]:
    ctx, vocab = llm._ctx.ctx, llm.n_vocab()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    batch = (llama_cpp.llama_token * len(prompt))(*prompt)
    ids = []
    while True:
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(batch, len(batch))) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab,))
        ids.append(int(logits.argmax()))
        if len(ids) == wanted:
            return ids
        batch = (llama_cpp.llama_token * 1)(ids[-1])


MODES = {"generate": generate, "decode_loop": decode_loop}


def main() -> None:
    path = sys.argv[1]
    models: dict[int, llama_cpp.Llama] = {}
    print(json.dumps({"version": llama_cpp.__version__,
                      "system_info": llama_cpp.llama_print_system_info().decode().strip()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        threads = request["threads"]
        if threads not in models:
            models[threads] = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                                              n_ctx=1024, n_batch=512, verbose=False, seed=0)
        llm = models[threads]
        prompt = llm.tokenize(request["prompt"].encode(), add_bos=True)
        start = time.perf_counter()
        ids = MODES[request["mode"]](llm, prompt, request["tokens"])
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "token_ids": ids, "prompt_tokens": len(prompt)}), flush=True)


if __name__ == "__main__":
    main()
