"""`baton worker`: one engine behind the internal API, in a prefill, decode or both role."""

from __future__ import annotations

import logging
import os
import sys

from baton.engine.config import DEFAULT_TPOT_OBJECTIVE_S, PROMPT_PRODUCTS, QUANTIZATIONS
from baton.engine.step_budget import (
    COLOCATED_BANK_OBJECTIVES,
    COLOCATED_PROMPT_SHARE,
    DEFAULT_BANK_OBJECTIVES,
)
from baton.kv.transport import TOKEN_ENV
from baton.server.cpu_priority import PRIORITIES
from baton.server.settings import KV_TRANSPORTS, WorkerSettings


def add_arguments(parser) -> None:
    parser.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    parser.add_argument("--model", default="bundled", help="HF folder, .gguf file, or 'bundled'")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--kv-port", type=int, default=8101, help="TCP port of the KV receiver (0: any free)")
    parser.add_argument("--kv-transport", choices=KV_TRANSPORTS, default="auto",
                        help="how this worker receives KV (auto: tcp); senders follow the ticket")
    parser.add_argument("--advertise-host", default=None, help="host other workers reach this one at")
    parser.add_argument("--worker-id", default=None, help="identity in tickets (default: host-port)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="the KV cache's dtype (auto: the activations', but bf16 under the float32 "
                        "activations --dtype auto keeps on quantized weights where the CPU has bf16 in "
                        "hardware); a prefill and a decode worker must agree")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="auto: products on a GGUF checkpoint's quantized blocks as they are "
                        "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; Q4_K, Q5_K and IQ4_XS rewritten at load into "
                        "Q4_1, Q5_1 and IQ4_NL, every other block format the gguf package reads (Q6_K, Q3_K, "
                        "Q2_K, IQ2...) requantized to Q8_0); none: weights at full precision (--dtype)")
    parser.add_argument("--prompt-products", default="auto", choices=PROMPT_PRODUCTS,
                        help="on CPU, what the many-row products on quantized weights (prompt chunks) "
                        "run on: auto = AMX tiles where the CPU has them, else int8 on AVX512-VNNI "
                        "or on AVX2 without AVX-512 (each row's largest inputs kept in float), else AVX512-BF16; int8 or bf16 "
                        "ask for one (an error where this CPU has none)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=512,
                        help="longest prefill chunk (0: whole prompts): on a decode worker it "
                        "bounds the steps beside its decodes, on a prefill worker the step a "
                        "shorter prompt that arrives may wait for")
    parser.add_argument("--tpot-objective-ms", type=float, default=DEFAULT_TPOT_OBJECTIVE_S * 1e3,
                        help="cap prompt tokens per step so running decodes keep this time per "
                        "output token, each gap between tokens too (from measured step costs; "
                        "0: no cap)")
    parser.add_argument("--tpot-bank-objectives", type=float, default=None,
                        help="the longest step that time saved against the objective may buy, in "
                        "objectives: 1 keeps every step within it (each gap between tokens), more "
                        "lets a prompt run in fewer, larger chunks (default: on a colocated worker, "
                        "role both, whose prompts have no other worker, from 1 up to "
                        f"{COLOCATED_BANK_OBJECTIVES:g}, as far as leaves a prompt chunk "
                        f"{COLOCATED_PROMPT_SHARE * 100:.0f}%% of a step beside its decodes; "
                        f"{DEFAULT_BANK_OBJECTIVES:g} otherwise)")
    parser.add_argument("--commit-hold", type=float, default=0.5,
                        help="a decode worker waits up to this fraction of a step before starting "
                        "one, for a prompt whose KV is due that soon (from the pace its layers "
                        "arrive), so it joins this step rather than the next; 0: never")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size (overrides memory)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (of each rank)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over this many processes (ranks) on this machine; "
                        "--cpu-core's cores are shared out among them")
    parser.add_argument("--cpu-core", type=int, action="append", default=[],
                        help="pin the process to this CPU core (repeatable)")
    parser.add_argument("--ray-address", default=None,
                        help="start the other tensor-parallel ranks as Ray actors, their cores reserved "
                        "as a placement group on this node of the Ray cluster at this address "
                        "(baton up passes it; default: child processes of this one)")
    parser.add_argument("--rank-placement", choices=["pack", "spread"], default="pack",
                        help="with --ray-address: the other ranks on this node (pack) or each on a "
                        "Ray node of its own, none of them this one's (spread: the model's ranks "
                        "over several machines, their collectives and KV over the network)")
    parser.add_argument("--prefill-cpu-priority", choices=PRIORITIES, default="normal",
                        help="while this is a one-process prefill worker, its threads' CPU priority: "
                        "idle (SCHED_IDLE) runs them only when nothing else on their cores wants to, "
                        "so that on a machine shared with decode workers and the router their "
                        "latency-bound threads go first, and long prompts wait longer where this "
                        "worker is busy (baton up --prefill-cpu-priority idle sets it where a prefill "
                        "worker's cores are its own); a worker converted to another role returns to normal")
    parser.add_argument("--peers", default="", help="comma-separated decode worker URLs to migrate to on drain")
    parser.add_argument("--ticket-ttl", type=float, default=30.0, help="seconds a reservation waits for its KV")
    parser.add_argument("--queue-timeout", type=float, default=30.0,
                        help="seconds a generate request may wait for room (KV, batch) before it "
                             "first runs; then the answer is 429 queue_timeout (the router's 429)")
    parser.add_argument("--insecure-no-token", action="store_true",
                        help=f"run without {TOKEN_ENV} (local use only: the internal API is open)")
    parser.add_argument("--log-level", default="info")


def settings_from_args(args) -> WorkerSettings:
    return WorkerSettings(
        role=args.role, model=None if args.model in ("bundled", "", None) else args.model,
        host=args.host, port=args.port, kv_port=args.kv_port, kv_transport=args.kv_transport,
        advertise_host=args.advertise_host, worker_id=args.worker_id, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization, prompt_products=args.prompt_products,
        block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
        chunk_size=args.chunk_size,
        tpot_objective_s=args.tpot_objective_ms / 1e3, tpot_bank_objectives=args.tpot_bank_objectives,
        commit_hold=args.commit_hold,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs, threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        cpu_cores=list(args.cpu_core), prefill_cpu_priority=args.prefill_cpu_priority,
        ray_address=args.ray_address, rank_placement=args.rank_placement,
        peers=[p for p in args.peers.split(",") if p],
        ticket_ttl_s=args.ticket_ttl, insecure_no_token=args.insecure_no_token,
        queue_timeout_s=args.queue_timeout,
    )


def pin_cpu(cores: list[int], threads: int | None) -> None:
    """Give the worker its own cores: at start, before any thread does (threads inherit
    affinity), and again when its tensor-parallel group changes (then every thread is moved)."""
    import torch

    if cores:
        os.sched_setaffinity(0, set(cores))
        for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
            try:
                os.sched_setaffinity(int(tid), set(cores))
            except OSError:  # a thread that ended meanwhile
                pass
    count = threads or (len(cores) if cores else None)
    if count:
        torch.set_num_threads(count)


def run(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    try:
        settings.validate()
    except ValueError as exc:
        print(f"baton worker: {exc}", file=sys.stderr)
        return 2
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and not settings.insecure_no_token:
        print(f"baton worker: {TOKEN_ENV} is not set; set it (callers send it as a bearer token) "
              "or pass --insecure-no-token for local use", file=sys.stderr)
        return 2
    from baton.engine.parallel.launcher import rank_cores

    # this process is rank 0; the other ranks pin themselves to their own share
    pin_cpu(rank_cores(settings.cpu_cores, settings.tensor_parallel_size, 0), settings.threads)

    import uvicorn

    from baton.server.app import create_app
    from baton.server.keepalive import SERVER_IDLE_S
    from baton.server.worker import Worker

    app = create_app(Worker(settings, token))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level.lower(),
                access_log=False, timeout_graceful_shutdown=5, timeout_keep_alive=SERVER_IDLE_S)
    return 0
