"""Secret, PodDisruptionBudget, NetworkPolicy and ServiceMonitor of one PDDeployment."""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass, field
from typing import Any

from baton.autoscaler.inputs import PolicyConfig

from .. import labels
from .names import router_service_name, secret_name, workers_policy_name
from .workers import TOKEN_KEY

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by Kubernetes


def internal_token_secret(deployment: str, token: str | None = None) -> dict[str, Any]:
    """Generated once; the operator never rewrites `data`, so workers keep a stable token."""
    value = token or secrets.token_urlsafe(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": secret_name(deployment),
                     "labels": labels.common(deployment, labels.WORKER)},
        "data": {TOKEN_KEY: base64.b64encode(value.encode()).decode()},
    }


def disruption_budget(share: float = PolicyConfig.conversion_share) -> str:
    """The PDB's maxUnavailable for a conversion share, as a percentage of the workers."""
    return f"{share * 100:g}%"


def worker_disruption_budget(deployment: str) -> dict[str, Any]:
    """Voluntary evictions limited to the share of workers the autoscaler converts at once.

    Kubernetes rounds a percentage up, so a small fleet still allows one; the policy's own
    limit (that share of the source pool, rounded down) always fits inside this budget.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": workers_policy_name(deployment),
                     "labels": labels.common(deployment, labels.WORKER)},
        "spec": {
            "maxUnavailable": disruption_budget(),
            "selector": {"matchLabels": labels.selector(deployment, labels.WORKER)},
        },
    }


@dataclass(frozen=True)
class PolicyPeers:
    """Who else may call worker port 8100 besides the deployment's own router and workers.

    operator_namespace: where the operator runs (None: unknown, any namespace); its pods are
    recognised by labels.OPERATOR_POD. Metrics scrapers: pods with `scraper_labels` in
    `scraper_namespace`; either may be empty (any pod / any namespace), not both (nobody).
    """

    operator_namespace: str | None = None
    scraper_namespace: str | None = None
    scraper_labels: dict[str, str] = field(default_factory=dict)


def _namespace_selector(namespace: str | None) -> dict[str, Any]:
    return {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}} if namespace else {}


def worker_network_policy(deployment: str, peers: PolicyPeers | None = None) -> dict[str, Any]:
    """Worker ports 8100 and 8101 are reachable from this deployment's router and its other
    workers (requests, KV handoff, migrations); port 8100 also from the operator (drain and
    role calls, the controller's scrapes) and from metrics scrapers (/metrics)."""
    peers = peers or PolicyPeers()
    worker_port = [{"protocol": "TCP", "port": labels.WORKER_PORT}]
    rules: list[dict[str, Any]] = [
        {
            "from": [
                {"podSelector": {"matchLabels": labels.selector(deployment, labels.ROUTER)}},
                {"podSelector": {"matchLabels": labels.selector(deployment, labels.WORKER)}},
            ],
            "ports": [*worker_port, {"protocol": "TCP", "port": labels.KV_PORT}],
        },
        {
            "from": [{"namespaceSelector": _namespace_selector(peers.operator_namespace),
                      "podSelector": {"matchLabels": dict(labels.OPERATOR_POD)}}],
            "ports": worker_port,
        },
    ]
    if peers.scraper_namespace or peers.scraper_labels:
        rules.append({
            "from": [{"namespaceSelector": _namespace_selector(peers.scraper_namespace),
                      "podSelector": {"matchLabels": dict(peers.scraper_labels)}}],
            "ports": worker_port,
        })
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": workers_policy_name(deployment),
                     "labels": labels.common(deployment, labels.WORKER)},
        "spec": {
            "podSelector": {"matchLabels": labels.selector(deployment, labels.WORKER)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def service_monitor(deployment: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Scrapes every worker and router Service of the deployment (their ports are named http).

    extra_labels: what the cluster's Prometheus selects ServiceMonitors by (kube-prometheus-
    stack picks only those labelled `release: <its release>`)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": router_service_name(deployment),
                     "labels": {**(extra_labels or {}), **labels.common(deployment, labels.WORKER)}},
        "spec": {
            "selector": {"matchLabels": {labels.NAME: "baton", labels.DEPLOYMENT: deployment}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }
