"""`baton up`: the whole stack on this machine (or a Ray cluster) until Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from baton.local.runtime import LocalStack, StackSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=0, help="prefill workers")
    parser.add_argument("--decode", type=int, default=0, help="decode workers")
    parser.add_argument("--colocated", type=int, default=0, help="workers doing both (no disaggregation)")
    parser.add_argument("--chunk-size", type=int, default=None, help="workers' longest prefill chunk (0: whole)")
    parser.add_argument("--port", type=int, default=8000, help="router port (0: any free)")
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    parser.add_argument("--disagg-threshold", default=None, help="router: tokens or 'auto'")
    parser.add_argument("--autoscale", action="store_true", help="also run the controller (role conversions)")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    parser.add_argument("--worker-arg", action="append", default=[],
                        help="extra `baton worker` argument, e.g. --worker-arg=--dtype=float32 (repeatable)")


def spec_from_args(args: argparse.Namespace) -> StackSpec:
    return StackSpec(prefill=args.prefill, decode=args.decode, colocated=args.colocated,
                     chunk_size=args.chunk_size, port=args.port, model=args.model,
                     address=args.address, disagg_threshold=args.disagg_threshold,
                     worker_args=list(args.worker_arg), log_dir=args.log_dir)


def catch_stop_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    catch_stop_signals(stop)
    stack = LocalStack(spec_from_args(args))
    try:
        stack.start()
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"baton up: {e}", file=sys.stderr)
        return 1
    catch_stop_signals(stop)  # again: ray.init installs its own SIGTERM handler
    controller = None
    try:
        roles = ", ".join(f"{w.role}@{w.url}" for w in stack.workers)
        print(f"Baton is up: {stack.url}/v1  (workers: {roles}; logs: {stack.log_dir})", flush=True)
        if args.autoscale:
            from baton.local.autoscale import start_controller

            controller = start_controller(stack)
        print("Press Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        if controller is not None:
            controller.stop()
        stack.stop()
        print("baton up: stopped", flush=True)
    return 0
