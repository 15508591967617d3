"""`baton operator`: run the kopf operator for PDDeployments."""

from __future__ import annotations

import argparse
import asyncio
import os

import kopf

from .config import OperatorConfig
from .handlers import register
from .manifests.policy import PolicyPeers


def label_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--resync-seconds", type=float, default=30.0,
                        help="full reconcile pass period when nothing changes")
    parser.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE"),
                        help="the namespace this operator runs in (default: $POD_NAMESPACE); "
                        "worker NetworkPolicies admit its pods there")
    parser.add_argument("--metrics-namespace", default=os.environ.get("BATON_METRICS_NAMESPACE"),
                        help="namespace whose pods may scrape worker /metrics through the "
                        "NetworkPolicy (with --metrics-pod-label: only those pods there)")
    parser.add_argument("--metrics-pod-label", action="append", default=[], metavar="KEY=VALUE",
                        type=label_pair, help="pods with this label (repeatable; in any "
                        "namespace unless --metrics-namespace) may scrape worker /metrics")
    parser.add_argument("--service-monitor-label", action="append", default=[],
                        metavar="KEY=VALUE", type=label_pair,
                        help="label each deployment's ServiceMonitor with this (repeatable), e.g. "
                        "release=kube-prometheus-stack, which that stack's Prometheus selects by")
    parser.add_argument("--liveness-port", type=int, default=8080,
                        help="port of kopf's liveness endpoint (/healthz)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics of this process on this port (0: off)")
    parser.add_argument("--allow-host-path", action="append", default=[], metavar="PREFIX",
                        help="let PDDeployments load models from node folders under PREFIX "
                        "(repeatable); without it a hostPath model source is refused")
    parser.add_argument("--verbose", action="store_true")


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    peers = PolicyPeers(operator_namespace=args.operator_namespace or None,
                        scraper_namespace=args.metrics_namespace or None,
                        scraper_labels=dict(args.metrics_pod_label))
    return OperatorConfig(resync_seconds=args.resync_seconds, policy_peers=peers,
                          service_monitor_labels=dict(args.service_monitor_label),
                          allowed_host_paths=tuple(args.allow_host_path))


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
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
        namespaces=args.namespace,  # kopf wants a collection: None crashes its namespace observer
        standalone=True,
        liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz",
    ))
    return 0
