"""The PromQL a PrometheusSource sends, as pure functions of the window and the scope.

Every query keeps one series per (worker, role): the fleet-level figures are computed from
those by `metrics.summarise`, the same code the scraping source uses.
"""

from __future__ import annotations

import re

from .metrics import COUNTERS, GAUGES, ROLE_GAUGE

_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


def check_window(window: str) -> str:
    """A PromQL range duration such as "30s" or "1m30s"; raises ValueError otherwise."""
    if not _DURATION.match(window):
        raise ValueError(f"not a PromQL duration: {window!r}")
    return window


def selector(metric: str, matchers: str = "") -> str:
    """`metric{matchers}`; matchers is PromQL label-matcher text such as 'namespace="ml"'."""
    return f"{metric}{{{matchers}}}" if matchers else metric


def counter_rate_query(metric: str, window: str, worker_label: str = "instance",
                       matchers: str = "") -> str:
    """Per-second rate of a counter (or histogram _sum/_count) per worker and role."""
    return (f"sum by ({worker_label}, role) "
            f"(rate({selector(metric, matchers)}[{check_window(window)}]))")


def gauge_query(metric: str, worker_label: str = "instance", matchers: str = "") -> str:
    """Latest value of a gauge per worker and role."""
    return f"sum by ({worker_label}, role) ({selector(metric, matchers)})"


def role_query(worker_label: str = "instance", matchers: str = "") -> str:
    """1 on the series of each worker's current role."""
    return f"max by ({worker_label}, role) ({selector(ROLE_GAUGE, matchers)})"


def snapshot_queries(window: str, worker_label: str = "instance",
                     matchers: str = "") -> dict[str, str]:
    """SeriesRates field (or "role") -> query, everything one snapshot needs."""
    queries = {field: counter_rate_query(metric, window, worker_label, matchers)
               for metric, field in COUNTERS.items()}
    queries.update({field: gauge_query(metric, worker_label, matchers)
                    for metric, field in GAUGES.items()})
    queries["role"] = role_query(worker_label, matchers)
    return queries


def deployment_matchers(namespace: str, deployment: str) -> str:
    """Scope to one PDDeployment's worker pods as the Prometheus Operator labels them."""
    return f'namespace="{namespace}",pod=~"{re.escape(deployment)}-w-.*"'
