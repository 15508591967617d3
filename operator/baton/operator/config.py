"""Operator settings: one dataclass for Baton's knobs, one function for kopf's."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import kopf

from .manifests.policy import PolicyPeers

FINALIZER = "baton.dev/operator"


@dataclass
class OperatorConfig:
    # None: log in as kopf would (in-cluster service account, else kubeconfig).
    connection: kopf.ConnectionInfo | None = None
    worker_port: int = 8100  # the contract's port; tests point it at a loopback server
    worker_timeout: float = 5.0  # seconds per call to a worker's internal API
    resync_seconds: float = 30.0  # full reconcile pass even when nothing changed
    busy_seconds: float = 2.0  # next pass while drains or conversions are in flight
    request_timeout: float = 30.0  # seconds per Kubernetes API call
    watch_timeout: int = 300  # server-side watch timeout; the client waits a bit longer
    # besides router and workers, who may call workers: this operator, metrics scrapers
    policy_peers: PolicyPeers = field(default_factory=PolicyPeers)
    # labels on each deployment's ServiceMonitor, so the cluster's Prometheus selects it
    service_monitor_labels: dict[str, str] = field(default_factory=dict)
    allowed_host_paths: tuple[str, ...] = ()  # node folders a hostPath model may use; () = none


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="baton.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="baton.dev", key="last-handled-configuration")
    settings.watching.server_timeout = config.watch_timeout
    settings.watching.client_timeout = config.watch_timeout + 30
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = config.request_timeout
    settings.networking.connect_timeout = 10
    # One replica with a Recreate strategy: no peering objects needed.
    settings.peering.standalone = True
    settings.posting.level = logging.INFO
