"""`baton chat`: the engine alone, in this process: load a model, stream one chat answer."""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="bfloat16, float32 or auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("question", nargs="?", default="What is the capital of France?")


def run(args: argparse.Namespace) -> int:
    from baton.engine import Engine, SamplingParams

    started = time.perf_counter()
    engine = Engine(model=args.model, dtype=args.dtype)
    print(f"loaded {engine.model_name} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.question}])
    print(f"> {args.question}")
    engine.add_request(prompt, SamplingParams(max_tokens=args.max_tokens), request_id="demo")
    while engine.has_unfinished():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
    print()
    return 0
