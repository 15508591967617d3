"""A MetricsSource that scrapes the workers' `/metrics` directly (no Prometheus: `baton up`).

Rates come from two scrapes of the same worker: the previous one, or with `window_s` the
oldest one inside that window (as Prometheus' rate over a window: a period may see too few
long requests finish to measure them). The first snapshot after start (or after a worker
appears) has gauges but no rates: the loop holds until the second one.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton.server.keepalive import worker_http_client

from .metrics import (
    COUNTERS,
    GAUGES,
    ROLE_GAUGE,
    FleetSnapshot,
    MetricsUnavailable,
    SeriesRates,
    known,
    summarise,
)

log = logging.getLogger(__name__)

Targets = Sequence[str] | Callable[[], Sequence[str] | Awaitable[Sequence[str]]]


@dataclass
class RoleTotals:
    """Raw values of one worker's series under one role label, as exposed."""

    counters: dict[str, float]
    gauges: dict[str, float]
    role_flag: float | None = None  # value of baton_worker_role for this role


def parse_exposition(text: str) -> dict[str, RoleTotals]:
    """Prometheus text -> role label value -> totals; other labels are summed over (pure)."""
    by_role: dict[str, RoleTotals] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            role = sample.labels.get("role")
            if role is None:
                continue
            totals = by_role.setdefault(role, RoleTotals({}, {}))
            if sample.name in COUNTERS:
                key = COUNTERS[sample.name]
                totals.counters[key] = totals.counters.get(key, 0.0) + sample.value
            elif sample.name in GAUGES:
                key = GAUGES[sample.name]
                totals.gauges[key] = totals.gauges.get(key, 0.0) + sample.value
            elif sample.name == ROLE_GAUGE:
                totals.role_flag = sample.value
    return by_role


def counter_rate(before: float | None, after: float | None, seconds: float) -> float | None:
    """Per-second increase between two readings; a drop is a restart counted from zero."""
    if known(before) is None or known(after) is None or seconds <= 0:
        return None
    increase = after - before if after >= before else after
    return increase / seconds


def series_rates(worker: str, before: dict[str, RoleTotals] | None, after: dict[str, RoleTotals],
                 seconds: float) -> list[SeriesRates]:
    """Rates of one worker between two parsed scrapes; gauges from the later one (pure)."""
    found = []
    for role, now in after.items():
        rates = SeriesRates(worker=worker, role=role, current=now.role_flag == 1)
        if before is not None:
            # A series absent from the worker's previous scrape was created since, at zero
            # (labelled metrics appear on first use); that is a measurement, not a guess.
            previous = before.get(role)
            for key, value in now.counters.items():
                start = previous.counters.get(key, 0.0) if previous is not None else 0.0
                setattr(rates, key, counter_rate(start, value, seconds))
        for key, value in now.gauges.items():
            setattr(rates, key, known(value))
        found.append(rates)
    return found


Scrape = tuple[float, dict[str, RoleTotals]]  # (clock, parsed exposition)
WINDOW_SLACK = 1.25  # a scrape this much older than the window still starts it (timing jitter)


def window_start(history: Sequence[Scrape], now: float, window_s: float | None) -> Scrape | None:
    """The earlier scrape a rate is taken from: the oldest within `window_s` of `now` (with
    slack for jitter), else the latest; None: no earlier scrape (pure)."""
    if not history:
        return None
    if window_s is not None:
        for scrape in history:
            if now - scrape[0] <= window_s * WINDOW_SLACK:
                return scrape
    return history[-1]


class ScrapeSource:
    """Scrapes `{base}/metrics` of every target each call; targets: URLs or a function of now.

    timeout: seconds per scrape; window_s: rates over about this many seconds (None: since
    the previous scrape). A worker that does not answer is left out of this period's rates
    and counted in `unanswered` (its traffic is missing, so the loop holds), and its earlier
    scrapes are kept for the next rate.
    """

    def __init__(self, targets: Targets, timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, window_s: float | None = None) -> None:
        self._targets = targets
        self._clock = clock
        self._client = worker_http_client(timeout=timeout)
        self.window_s = window_s
        self._history: dict[str, deque[Scrape]] = {}  # per target, oldest first

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _target_list(self) -> list[str]:
        if not callable(self._targets):
            return list(self._targets)
        found = self._targets()
        if inspect.isawaitable(found):
            found = await found
        return list(found)

    async def _scrape(self, base: str) -> tuple[str, float, dict[str, RoleTotals] | None]:
        try:
            response = await self._client.get(base.rstrip("/") + "/metrics")
            response.raise_for_status()
            return base, self._clock(), parse_exposition(response.text)
        except (httpx.HTTPError, ValueError) as error:
            log.info("scrape of %s failed: %s", base, error)
            return base, self._clock(), None

    async def snapshot(self) -> FleetSnapshot:
        targets = await self._target_list()
        results = await asyncio.gather(*(self._scrape(t) for t in targets))
        if targets and all(parsed is None for _, _, parsed in results):
            raise MetricsUnavailable(f"none of {len(targets)} worker(s) answered /metrics")
        series: list[SeriesRates] = []
        for base, moment, parsed in results:
            if parsed is None:
                continue
            history = self._history.setdefault(base, deque())
            before = window_start(history, moment, self.window_s)
            seconds = moment - before[0] if before else 0.0
            series.extend(series_rates(base, before[1] if before else None, parsed, seconds))
            while history and history[0] is not before:  # older than any later window needs
                history.popleft()
            history.append((moment, parsed))
        for gone in set(self._history) - set(targets):
            del self._history[gone]
        unanswered = sum(1 for _, _, parsed in results if parsed is None)
        return replace(summarise(series), unanswered=unanswered)
