"""llama.cpp's side of bench/engine.py, run by its own venv's python (bench/setup_llama_cpp.sh):
one JSON request a line on stdin, one JSON answer a line on stdout.

    {"threads": 2, "prompt": "...", "tokens": 64}  ->  {"seconds": 0.41, "token_ids": [...]}

Greedy decoding of `tokens` tokens after the prompt, timed from the call to the last token
(the prompt's prefill included, as Baton's side times it). One model per thread count.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp


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
        wanted, ids = request["tokens"], []
        start = time.perf_counter()
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            ids.append(token)
            if len(ids) == wanted:
                break
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "token_ids": ids, "prompt_tokens": len(prompt)}), flush=True)


if __name__ == "__main__":
    main()
