"""Secret, PodDisruptionBudget, NetworkPolicy and ServiceMonitor of one PDDeployment."""

from __future__ import annotations

import base64
import secrets
from typing import Any

from baton.autoscaler.inputs import PolicyConfig

from .. import labels
from .names import router_service_name, secret_name, workers_policy_name
from .workers import TOKEN_KEY


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


def worker_network_policy(deployment: str, metrics_namespace: str | None = None) -> dict[str, Any]:
    """Worker ports are reachable only from this deployment's router and its other workers
    (KV handoff, migrations); optionally /metrics from one monitoring namespace."""
    ports = [{"protocol": "TCP", "port": labels.WORKER_PORT},
             {"protocol": "TCP", "port": labels.KV_PORT}]
    rules: list[dict[str, Any]] = [{
        "from": [
            {"podSelector": {"matchLabels": labels.selector(deployment, labels.ROUTER)}},
            {"podSelector": {"matchLabels": labels.selector(deployment, labels.WORKER)}},
        ],
        "ports": ports,
    }]
    if metrics_namespace:
        rules.append({
            "from": [{"namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": metrics_namespace}}}],
            "ports": [{"protocol": "TCP", "port": labels.WORKER_PORT}],
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


def service_monitor(deployment: str) -> dict[str, Any]:
    """Scrapes every worker and router Service of the deployment (their ports are named http)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": router_service_name(deployment),
                     "labels": labels.common(deployment, labels.WORKER)},
        "spec": {
            "selector": {"matchLabels": {labels.NAME: "baton", labels.DEPLOYMENT: deployment}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }
