"""`baton demo` (what `make run` runs): start the local stack, stream one chat answer to the
terminal through the official OpenAI client, and stop everything again."""

from __future__ import annotations

import argparse
import sys

from baton.local.runtime import LocalStack, StackSpec

QUESTION = "What is the capital of France?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--max-tokens", type=int, default=64)


def ask(base_url: str, question: str, max_tokens: int, out=sys.stdout) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    print(f"> {question}", file=out, flush=True)
    answer = ""
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], stream=True,
        max_tokens=max_tokens, temperature=0)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            answer += chunk.choices[0].delta.content
            print(chunk.choices[0].delta.content, end="", file=out, flush=True)
    print(file=out, flush=True)
    return answer


def run(args: argparse.Namespace) -> int:
    print("Starting Baton (workers load the model; this takes a little while)...", flush=True)
    stack = LocalStack(StackSpec(prefill=args.prefill, decode=args.decode, port=0, model=args.model))
    try:
        stack.start()
        print(f"Baton is up at {stack.url}/v1", flush=True)
        ask(stack.url, args.question, args.max_tokens)
    except (RuntimeError, TimeoutError) as e:
        print(f"baton demo: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
    return 0
