"""`baton up`: the whole stack on this machine (or a Ray cluster) until Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from baton.autoscaler.inputs import PolicyConfig
from baton.local.runtime import LocalStack, StackSpec
from baton.local.supervisor import Liveness
from baton.server.cpu_priority import PRIORITIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=0, help="prefill workers")
    parser.add_argument("--decode", type=int, default=0, help="decode workers")
    parser.add_argument("--colocated", type=int, default=0, help="workers doing both (no disaggregation)")
    parser.add_argument("--prefill-tp", type=int, default=1, metavar="N",
                        help="tensor-parallel ranks per prefill worker (each rank a process on its own core)")
    parser.add_argument("--decode-tp", type=int, default=1, metavar="N",
                        help="tensor-parallel ranks per decode (and colocated) worker")
    parser.add_argument("--chunk-size", type=int, default=None, help="workers' longest prefill chunk (0: whole)")
    parser.add_argument("--port", type=int, default=8000, help="router port (0: any free)")
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    parser.add_argument("--rank-placement", choices=["pack", "spread"], default="pack",
                        help="a tensor-parallel worker's other ranks on its own node (pack) or each "
                        "on a node of its own (spread: needs a cluster of size-many nodes, --address)")
    parser.add_argument("--prefill-cpu-priority", choices=PRIORITIES, default="normal",
                        help="idle: each prefill worker whose cores no other worker shares runs at "
                        "SCHED_IDLE, so the router's and the decode workers' threads that wake up run "
                        "on its cores instead of preempting a decode step: smoother decoding, slower "
                        "long prompts where prefill is busy (docs/benchmarks.md); not with --autoscale")
    parser.add_argument("--disagg-threshold", default=None, help="router: tokens or 'auto'")
    parser.add_argument("--autoscale", action="store_true", help="also run the controller (role conversions)")
    group = parser.add_argument_group("autoscaling (with --autoscale)")
    group.add_argument("--autoscale-period", type=float, default=15.0, metavar="SECONDS",
                       help="seconds between decisions")
    group.add_argument("--autoscale-window", type=float, default=None, metavar="SECONDS",
                       help="seconds of traffic each decision measures (default: two periods)")
    group.add_argument("--autoscale-persist", type=int, default=PolicyConfig.persist_periods, metavar="PERIODS",
                       help="periods a change must be wanted before it is made (an urgent one acts at once)")
    group.add_argument("--autoscale-cooldown", type=float, default=PolicyConfig.cooldown_s, metavar="SECONDS",
                       help="least quiet time after a conversion (longer while the conversion itself takes longer)")
    group.add_argument("--slo", default=None, metavar="ttft=2s,tpot=50ms",
                       help="latency objectives the sizing plans for and the workers keep "
                            "their decodes within (default: "
                            f"ttft={PolicyConfig.ttft_slo_s:g}s,tpot={PolicyConfig.tpot_slo_s * 1e3:g}ms)")
    group.add_argument("--controller-port", type=int, default=0,
                       help="port of the controller's /decisions and /metrics (0: any free one)")
    parser.add_argument("--liveness-period", type=float, default=Liveness.period_s, metavar="SECONDS",
                        help="seconds between liveness probes of each server (/health, as a pod's "
                             "periodSeconds)")
    parser.add_argument("--liveness-failures", type=int, default=Liveness.failures, metavar="N",
                        help="failed probes in a row before a server is restarted (failureThreshold)")
    parser.add_argument("--no-restart", action="store_true",
                        help="leave a server process that exits down (default: restart it with back-off, "
                             "as a kubelet does)")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    parser.add_argument("--quantization", choices=["auto", "none"], default=None,
                        help="workers' weights: auto (the default) serves a GGUF's quantized blocks "
                        "as they are, none dequantizes them to --dtype")
    parser.add_argument("--prompt-products", choices=["auto", "int8", "bf16"], default=None,
                        help="on CPU, what workers' many-row products on quantized weights run on: auto "
                        "(the default) = AMX tiles where the CPU has them, else int8 on AVX512-VNNI or AVX2, else "
                        "AVX512-BF16; int8 or bf16 ask for one")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "float16", "float32"], default=None,
                        help="workers' KV cache dtype: auto (the default) is the activations' dtype, or "
                             "bf16 under float32 activations on a CPU with bf16 in hardware; prefill and "
                             "decode workers must agree")
    parser.add_argument("--worker-arg", action="append", default=[],
                        help="extra `baton worker` argument, e.g. --worker-arg=--dtype=float32 (repeatable)")
    parser.add_argument("--router-arg", action="append", default=[],
                        help="extra router argument, e.g. --router-arg=--reserve-wait=3 (repeatable)")


def spec_from_args(args: argparse.Namespace) -> StackSpec:
    from baton.loadgen.stats import parse_slo

    tpot = parse_slo(args.slo).tpot if args.slo else None
    if tpot is None and args.autoscale:
        tpot = PolicyConfig.tpot_slo_s
    # the workers keep running decodes within the same TPOT objective the sizing plans for
    extra = ["--tpot-objective-ms", f"{tpot * 1e3:g}"] if tpot else []
    if args.quantization:
        extra.append(f"--quantization={args.quantization}")
    if args.prompt_products:
        extra.append(f"--prompt-products={args.prompt_products}")
    if args.kv_cache_dtype:
        extra.append(f"--kv-cache-dtype={args.kv_cache_dtype}")
    if args.rank_placement != "pack":
        extra.append(f"--rank-placement={args.rank_placement}")
    return StackSpec(prefill=args.prefill, decode=args.decode, colocated=args.colocated,
                     prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, convertible=args.autoscale,
                     prefill_cpu_priority=args.prefill_cpu_priority,
                     chunk_size=args.chunk_size, port=args.port, model=args.model,
                     address=args.address, disagg_threshold=args.disagg_threshold,
                     worker_args=extra + list(args.worker_arg), router_args=list(args.router_arg),
                     log_dir=args.log_dir, restart=not args.no_restart, liveness=liveness_from_args(args))


def liveness_from_args(args: argparse.Namespace) -> Liveness:
    if not args.liveness_period > 0 or args.liveness_failures < 1:
        raise ValueError(f"--liveness-period must be positive and --liveness-failures at least 1, got "
                         f"{args.liveness_period:g} and {args.liveness_failures}")
    return Liveness(period_s=args.liveness_period, timeout_s=min(Liveness.timeout_s, args.liveness_period),
                    failures=args.liveness_failures)


def autoscale_settings(args: argparse.Namespace):
    """The controller's settings from the arguments (raises ValueError on bad ones)."""
    from baton.loadgen.stats import parse_slo
    from baton.local.autoscale import AutoscaleSettings

    if args.autoscale_period <= 0 or (args.autoscale_window is not None and args.autoscale_window <= 0):
        raise ValueError("--autoscale-period and --autoscale-window must be positive")
    if args.autoscale_persist < 1 or args.autoscale_cooldown < 0:
        raise ValueError("--autoscale-persist must be at least 1, --autoscale-cooldown not negative")
    slo = parse_slo(args.slo)
    policy = PolicyConfig(ttft_slo_s=slo.ttft or PolicyConfig.ttft_slo_s,
                          tpot_slo_s=slo.tpot or PolicyConfig.tpot_slo_s,
                          persist_periods=args.autoscale_persist, cooldown_s=args.autoscale_cooldown)
    return AutoscaleSettings(period_s=args.autoscale_period, window_s=args.autoscale_window, policy=policy,
                             port=args.controller_port)


def catch_stop_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def cpu_line() -> str:
    """What the workers' `--dtype auto` means on this machine, and why. Their kernels (the
    quantized products' int8 or bf16 engine among them) are each worker's log's to name: they
    follow the native library built there."""
    from baton.engine.cpu_features import auto_cpu_dtype, this_cpu

    dtype, why = auto_cpu_dtype(this_cpu())
    prompts = " (prompt attention in bfloat16)" if dtype == "bfloat16" else ""
    return (f"CPU: {this_cpu().describe()}; --dtype auto runs {dtype} here ({why}), "
            f"float32 where the weights stay quantized{prompts}; each worker's log names its kernels")


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    catch_stop_signals(stop)
    try:
        settings = autoscale_settings(args) if args.autoscale else None
        spec = spec_from_args(args)
        spec.check()
    except ValueError as e:
        print(f"baton up: {e}", file=sys.stderr)
        return 2
    print(cpu_line(), flush=True)
    stack = LocalStack(spec)
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
        if settings is not None:
            from baton.local.autoscale import start_controller

            controller = start_controller(stack, settings)
            print(f"Autoscaler: {controller.url} (/decisions, /metrics; a decision every "
                  f"{settings.period_s:g}s)", flush=True)
        print("Press Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        if controller is not None:
            controller.stop()
        restarts = ", ".join(f"{name} {n}" for name, n in stack.restarts.items() if n)
        stack.stop()
        print(f"baton up: stopped (restarts: {restarts or 'none'})", flush=True)
    return 0
