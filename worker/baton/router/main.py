"""`baton router`: the OpenAI-compatible frontend in front of prefill and decode workers."""

from __future__ import annotations

import argparse
import logging
import os

from baton.router.auth import is_loopback
from baton.router.threshold import DEFAULT_STALL_WEIGHT, parse_stall_weight, parse_threshold
from baton.server.heap import freeze_startup_heap

log = logging.getLogger("baton.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--host", default=env("BATON_ROUTER_HOST", "127.0.0.1"),
                        help="address to bind (default loopback; 0.0.0.0 to serve others: set a key)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", default=env("BATON_WORKERS", ""),
                        help="static discovery: comma-separated worker URLs (http://host:port)")
    parser.add_argument("--discovery", choices=["static", "kubernetes"], default=None,
                        help="default: static when --workers is given")
    parser.add_argument("--deployment", default=env("BATON_DEPLOYMENT"), help="PDDeployment name (kubernetes)")
    parser.add_argument("--namespace", default=None, help="default: POD_NAMESPACE or the pod's own")
    parser.add_argument("--kube-api", default=None, help="API server URL (default: in-cluster)")
    parser.add_argument("--worker-port", type=int, default=8100, help="workers' HTTP port (kubernetes)")
    parser.add_argument("--model", default=env("BATON_MODEL"),
                        help="the workers' model, for its tokenizer: HF folder, .gguf file, or "
                        "'bundled' (the default: the bundled SmolLM2)")
    parser.add_argument("--served-model-name", default=None, help="name clients send (default: the model's)")
    parser.add_argument("--block-size", type=int, default=int(env("BATON_BLOCK_SIZE", "16")),
                        help="the workers' KV block size (prefix hashes must match)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--api-key", default=env("BATON_API_KEY"),
                        help="clients must send this bearer key (also BATON_API_KEY)")
    parser.add_argument("--disagg-threshold", default=env("BATON_DISAGG_THRESHOLD", "auto"),
                        help="uncached prompt tokens from which prefill goes to a prefill worker, "
                             "or 'auto' to derive it from measured overhead, speed and bandwidth")
    parser.add_argument("--stall-weight", default=env("BATON_STALL_WEIGHT", ""),
                        help="with the threshold 'auto': what the time a prompt costs others (streams a "
                             "local prefill slows, prompts a remote one holds up) counts for against its "
                             f"own time to first token, >= 0 (default {DEFAULT_STALL_WEIGHT}; 1: all time alike)")
    parser.add_argument("--max-running", type=int, default=256, help="requests in flight at once")
    parser.add_argument("--max-waiting", type=int, default=1024, help="queued beyond that, then 429")
    parser.add_argument("--max-body-bytes", type=int, default=int(env("BATON_MAX_BODY_BYTES", str(4 << 20))),
                        help="larger request bodies are refused with 413 before they are read")
    parser.add_argument("--reserve-headroom-tokens", type=int, default=256,
                        help="generation room a decode reservation holds beyond the prompt (at "
                             "most max_tokens); past it the decode worker grows the sequence as it goes")
    parser.add_argument("--reserve-wait", type=float, default=None,
                        help="seconds a request waits for KV room on some decode worker before it "
                             "is prefilled where it decodes and queued there (default: 10)")
    parser.add_argument("--decode-routing", choices=["prefix", "load"], default=env("BATON_DECODE_ROUTING", "prefix"),
                        help="prefix: a decode worker holding more of the prompt's prefix in its cache is "
                             "chosen while its load is near the least busy one's; load: the least busy only")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between worker state polls")
    parser.add_argument("--log-level", default="warning")


def model_path(value: str | None) -> str | None:
    """`--model` as the worker reads it: 'bundled' (or nothing) is the bundled model."""
    return None if value in (None, "", "bundled") else value


def build_app(args: argparse.Namespace):
    from baton.router.app import RouterConfig, create_app
    from baton.router.discovery import KubernetesDiscovery, StaticDiscovery
    from baton.router.dispatch import Deadlines
    from baton.router.tokenizing import load_model_info

    kind = args.discovery or ("static" if args.workers else None)
    if kind == "static":
        discovery = StaticDiscovery(args.workers.split(","))
        if not discovery.urls:
            raise SystemExit("--workers is empty")
    elif kind == "kubernetes":
        if not args.deployment:
            raise SystemExit("--discovery kubernetes needs --deployment")
        discovery = KubernetesDiscovery(args.deployment, args.namespace, args.kube_api,
                                        worker_port=args.worker_port)
    else:
        raise SystemExit("give --workers URL,URL or --discovery kubernetes --deployment NAME")
    if args.decode_routing not in ("prefix", "load"):  # argparse leaves an environment default unchecked
        raise SystemExit(f"--decode-routing (BATON_DECODE_ROUTING) must be 'prefix' or 'load', got {args.decode_routing!r}")
    if args.reserve_wait is not None and not args.reserve_wait > 0:
        raise SystemExit(f"--reserve-wait must be a positive number of seconds, got {args.reserve_wait}")
    try:
        stall_weight, threshold = parse_stall_weight(args.stall_weight), parse_threshold(args.disagg_threshold)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    deadlines = Deadlines() if args.reserve_wait is None else Deadlines(reserve_wait_s=args.reserve_wait)
    model = load_model_info(model_path(args.model), args.served_model_name, args.max_model_len)
    config = RouterConfig(
        block_size=args.block_size, api_key=args.api_key or None,
        internal_token=os.environ.get("BATON_INTERNAL_TOKEN"),
        disagg_threshold=threshold, stall_weight=stall_weight,
        max_running=args.max_running, max_waiting=args.max_waiting, poll_interval_s=args.poll_interval,
        max_body_bytes=args.max_body_bytes, reserve_headroom_tokens=args.reserve_headroom_tokens,
        deadlines=deadlines, prefix_affinity=args.decode_routing == "prefix")
    return create_app(model, discovery, config)


# Idle client connections stay open longer than common clients keep them (httpx 5 s, aiohttp
# 15 s) and than cloud load balancers' idle timeouts (60 s), so the other side closes first
# and never sends a request into a connection the router is closing.
CLIENT_FACING_IDLE_S = 75
SERVER_OPTIONS = {"access_log": False, "timeout_keep_alive": CLIENT_FACING_IDLE_S}


def warn_if_open(host: str, api_key: str | None) -> bool:
    """Log loudly when others can reach the API without a key; True when it did."""
    if api_key or is_loopback(host):
        return False
    log.warning("!!! the router serves %s with NO API key: anyone who can reach this port can "
                "use the model. Set --api-key or BATON_API_KEY (docs/security.md) !!!", host)
    return True


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    warn_if_open(args.host, args.api_key)
    # this process serves until it stops: what it holds now is never garbage (server/heap.py)
    log.info("router: startup heap frozen for the collector %s", freeze_startup_heap())
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, **SERVER_OPTIONS)
    return 0
