"""`baton operator`: run the kopf operator for PDDeployments."""

from __future__ import annotations

import argparse
import asyncio
import os

import kopf

from .config import OperatorConfig
from .handlers import register


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--resync-seconds", type=float, default=30.0,
                        help="full reconcile pass period when nothing changes")
    parser.add_argument("--metrics-namespace", default=os.environ.get("BATON_METRICS_NAMESPACE"),
                        help="namespace allowed to scrape worker /metrics through the policy")
    parser.add_argument("--liveness-port", type=int, default=8080,
                        help="port of kopf's liveness endpoint (/healthz)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics of this process on this port (0: off)")
    parser.add_argument("--allow-host-path", action="append", default=[], metavar="PREFIX",
                        help="let PDDeployments load models from node folders under PREFIX "
                        "(repeatable); without it a hostPath model source is refused")
    parser.add_argument("--verbose", action="store_true")


def run(args: argparse.Namespace) -> int:
    config = OperatorConfig(resync_seconds=args.resync_seconds,
                            metrics_namespace=args.metrics_namespace or None,
                            allowed_host_paths=tuple(args.allow_host_path))
    registry = kopf.OperatorRegistry()
    register(registry, config)
    kopf.configure(verbose=args.verbose)
    if args.metrics_port:
        # The controller's baton_autoscaler_* metrics live in this process's default registry.
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    asyncio.run(kopf.operator(
        registry=registry,
        clusterwide=not args.namespace,
        namespaces=args.namespace or None,
        standalone=True,
        liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz",
    ))
    return 0
