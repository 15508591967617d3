"""A MetricsSource that asks Prometheus (through prometheus-api-client) for rates over a window."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_api_client import PrometheusConnect

from .metrics import FleetSnapshot, MetricsUnavailable, SeriesRates, known, summarise
from .promql import snapshot_queries


def _value(item: dict[str, Any]) -> float | None:
    try:
        return known(float(item["value"][1]))  # "NaN" and "+Inf" become None
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def series_from_results(results: dict[str, list[dict[str, Any]]],
                        worker_label: str = "instance") -> list[SeriesRates]:
    """Instant-vector results per field -> SeriesRates per (worker, role) (pure)."""
    by_key: dict[tuple[str, str], SeriesRates] = {}
    for field, items in results.items():
        for item in items:
            labels = item.get("metric", {})
            worker, role = labels.get(worker_label), labels.get("role")
            if worker is None or role is None:
                continue
            rates = by_key.setdefault((worker, role), SeriesRates(worker=worker, role=role))
            value = _value(item)
            if field == "role":
                rates.current = value == 1
            else:
                setattr(rates, field, value)
    return list(by_key.values())


class PrometheusSource:
    """Rates over `window` (a PromQL duration) from the Prometheus at `url`.

    matchers: label matchers scoping every query to one deployment's workers;
    worker_label: the label that tells workers apart ("instance", or "pod" on Kubernetes).
    The window should span at least two scrapes, else rates are missing and the loop holds.
    """

    def __init__(self, url: str, window: str = "1m", matchers: str = "",
                 worker_label: str = "instance", timeout: float = 10.0) -> None:
        self.queries = snapshot_queries(window, worker_label, matchers)
        self._worker_label = worker_label
        self._timeout = timeout
        self._client = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout)

    async def aclose(self) -> None:
        return None  # prometheus-api-client keeps no connection worth closing

    def _query_all(self) -> dict[str, list[dict[str, Any]]]:
        return {field: self._client.custom_query(query, timeout=self._timeout)
                for field, query in self.queries.items()}

    async def snapshot(self) -> FleetSnapshot:
        try:
            results = await asyncio.to_thread(self._query_all)
        except Exception as error:  # the client raises several unrelated types
            raise MetricsUnavailable(f"Prometheus query failed: {error}") from error
        return summarise(series_from_results(results, self._worker_label))
