"""What a control loop measures about a fleet, and the interface of the sources that measure it.

A source (Prometheus, or direct scraping of the workers' `/metrics`) reduces the workers'
counters to per-series rates over a window (`SeriesRates`); `summarise` turns those into one
`FleetSnapshot`. Both sources share `summarise`, so they can only differ in how they obtain
rates, never in what the rates mean. Anything not measured is None, never zero.

Assumptions about the worker metrics (docs/contracts.md), stated once here:
- a request finishes on a decode or colocated (`both`) worker, so those workers' E2E count
  is the arrival rate in steady state (prefill workers and routers are not counted);
- `baton_prompt_tokens_total` counts prompt tokens actually computed (prefix-cache hits
  excluded) and `baton_prefill_busy_seconds_total` the time of steps that prefilled, so
  their ratio is a worker's prefill supply in uncached tokens per busy second;
- a finishing worker counts each finished request's prompt and generated tokens
  (`baton_request_prompt_tokens`, `baton_request_generation_tokens`), so their sums over
  the E2E count are the mean lengths;
- each prompt is looked up in the prefix cache once, on the worker that prefills it, so
  prefix-cache queries per request stand in for the mean input length where those are missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

FINISHING_ROLES = ("decode", "both")
ROLES = ("prefill", "decode", "both")

# Exposed sample name -> SeriesRates field, for counters (rated) and gauges (latest value).
COUNTERS = {
    "baton_e2e_request_latency_seconds_count": "requests",
    "baton_prompt_tokens_total": "prompt_tokens",
    "baton_generation_tokens_total": "generation_tokens",
    "baton_request_prompt_tokens_sum": "finished_prompt_tokens",
    "baton_request_generation_tokens_sum": "finished_generation_tokens",
    "baton_prefix_cache_queries_total": "prefix_queries",
    "baton_prefix_cache_hits_total": "prefix_hits",
    "baton_prefill_busy_seconds_total": "prefill_busy",
    "baton_inter_token_latency_seconds_sum": "itl_sum",
    "baton_inter_token_latency_seconds_count": "itl_count",
    "baton_kv_exposed_transfer_seconds_sum": "exposed_sum",
    "baton_kv_exposed_transfer_seconds_count": "exposed_count",
}
GAUGES = {
    "baton_num_requests_running": "running",
    "baton_num_requests_waiting": "waiting",
    "baton_kv_cache_usage_ratio": "kv_usage",
    "baton_kv_cache_capacity_tokens": "kv_capacity",
}
ROLE_GAUGE = "baton_worker_role"  # 1 on the series of the worker's current role


class MetricsUnavailable(Exception):
    """The source could not be read at all this period (as opposed to a missing series)."""


@dataclass
class SeriesRates:
    """One worker's metrics under one `role` label value, rates in units per second.

    A worker keeps its old role's series after a conversion, so one worker can have several;
    `current` is True for the series of the role the worker reports now (baton_worker_role).
    """

    worker: str
    role: str
    current: bool = False
    requests: float | None = None  # finished requests/s (E2E histogram count)
    prompt_tokens: float | None = None  # computed prompt tokens/s
    generation_tokens: float | None = None
    finished_prompt_tokens: float | None = None  # prompt tokens/s of the requests that finished
    finished_generation_tokens: float | None = None  # their generated tokens/s
    prefix_queries: float | None = None  # prompt tokens looked up per s
    prefix_hits: float | None = None
    prefill_busy: float | None = None  # busy seconds per second
    itl_sum: float | None = None  # inter-token latency seconds per second
    itl_count: float | None = None  # inter-token gaps per second
    exposed_sum: float | None = None  # exposed transfer seconds per second
    exposed_count: float | None = None
    running: float | None = None  # gauges, latest value
    waiting: float | None = None
    kv_usage: float | None = None
    kv_capacity: float | None = None  # tokens the worker's KV pool holds


@dataclass(frozen=True)
class StepSample:
    """One decode worker's mean step time at its mean batch over the window."""

    worker: str
    batch: float
    step_s: float


@dataclass(frozen=True)
class FleetSnapshot:
    """The measured inputs of one period. None: not measured (no data, NaN, or 0/0)."""

    arrival_rate: float | None
    input_len: float | None
    output_len: float | None
    hit_rate: float | None
    prefill_supply: float | None  # uncached prompt tokens/s of one prefill worker while busy
    exposed_transfer_s: float | None
    decode_kv_usage: float | None  # mean KV usage ratio of decode workers
    decode_running: float | None  # mean running sequences per decode worker
    decode_kv_capacity: float | None = None  # mean KV pool tokens of decode workers, as they report it
    local_share: float | None = None  # share of computed prompt tokens prefilled on decode workers
    step_samples: tuple[StepSample, ...] = ()
    pools: dict[str, int] = field(default_factory=dict)  # role -> workers reporting it
    running: dict[str, float | None] = field(default_factory=dict)  # role -> running sequences
    waiting: dict[str, float | None] = field(default_factory=dict)
    workers: dict[str, str] = field(default_factory=dict)  # worker -> current role
    unanswered: int = 0  # workers whose metrics could not be read: the traffic is partial


class MetricsSource(Protocol):
    async def snapshot(self) -> FleetSnapshot:
        """Measure the fleet now; raise MetricsUnavailable if nothing could be read."""
        ...

    async def aclose(self) -> None: ...


def known(value: float | None) -> float | None:
    """The value if it is a finite number, else None."""
    if value is None or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator/denominator, None when either is unknown or the denominator is not positive."""
    num, den = known(numerator), known(denominator)
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _first_known(*values: float | None) -> float | None:
    """The first value that was measured.

    The mean lengths come from the finished requests themselves where workers count them
    (a request's lengths counted with its finish, as the arrival rate is). Prompt tokens
    looked up and tokens generated in the window, over the requests finished in it, agree in
    a steady state but not while the traffic's shape changes: a window in which long
    prompts are still prefilled and few requests finish read 2,900-token prompts of a
    1,200-token load. Workers without those histograms still give the window ratios.
    """
    return next((v for v in values if v is not None), None)


def _total(series: list[SeriesRates], name: str) -> float | None:
    """Sum of a field over series; None if no series measured it."""
    values = [v for s in series if (v := known(getattr(s, name))) is not None]
    return sum(values) if values else None


def _mean(values: list[float | None]) -> float | None:
    found = [v for v in values if known(v) is not None]
    return sum(found) / len(found) if found else None


def window_batch(running: float | None, gap_seconds_per_s: float | None) -> float | None:
    """The batch a decode worker stepped at over the window, for the decode step fit.

    The running gauge when it shows sequences. A worker caught idle at the scrape (short
    outputs finish between scrapes) still decoded at a batch of at least the time-averaged
    number of sequences between tokens (inter-token seconds per second, by Little's law)
    and at least one; None when it produced no gaps at all.
    """
    if running is not None and running > 0:
        return running
    if gap_seconds_per_s is None or gap_seconds_per_s <= 0:
        return None
    return max(1.0, gap_seconds_per_s)


def summarise(series: list[SeriesRates]) -> FleetSnapshot:
    """Reduce per-series rates to the fleet's measured inputs (pure)."""
    current = [s for s in series if s.current]
    workers = {s.worker: s.role for s in current}
    finishing = [s for s in series if s.role in FINISHING_ROLES]
    arrival = _total(finishing, "requests")
    queries = _total(series, "prefix_queries")

    prefill_series = [s for s in series if s.role == "prefill"]
    supply = ratio(_total(prefill_series, "prompt_tokens"), _total(prefill_series, "prefill_busy"))
    if supply is None:
        # No disaggregated prefill in the window: local prefills on other roles still measure it.
        supply = ratio(_total(series, "prompt_tokens"), _total(series, "prefill_busy"))

    decode_now = [s for s in current if s.role == "decode"]
    decode_series = {s.worker: s for s in series if s.role == "decode"}
    samples = []
    for gauge in decode_now:
        rates = decode_series[gauge.worker]
        step = ratio(rates.itl_sum, rates.itl_count)
        batch = window_batch(known(gauge.running), known(rates.itl_sum))
        if step is not None and batch is not None:
            samples.append(StepSample(gauge.worker, batch, step))

    pools = {role: sum(1 for r in workers.values() if r == role) for role in ROLES}
    return FleetSnapshot(
        arrival_rate=known(arrival),
        input_len=_first_known(ratio(_total(finishing, "finished_prompt_tokens"), arrival), ratio(queries, arrival)),
        output_len=_first_known(ratio(_total(finishing, "finished_generation_tokens"), arrival),
                                ratio(_total(series, "generation_tokens"), arrival)),
        hit_rate=ratio(_total(series, "prefix_hits"), queries),
        prefill_supply=supply,
        exposed_transfer_s=ratio(_total(series, "exposed_sum"), _total(series, "exposed_count")),
        decode_kv_usage=_mean([s.kv_usage for s in decode_now]),
        decode_running=_mean([s.running for s in decode_now]),
        decode_kv_capacity=_mean([s.kv_capacity for s in decode_now]),
        step_samples=tuple(samples),
        local_share=ratio(_total([s for s in series if s.role == "decode"], "prompt_tokens"),
                          _total([s for s in series if s.role in ("prefill", "decode")],
                                 "prompt_tokens")),
        pools=pools,
        running={role: _total([s for s in current if s.role == role], "running")
                 for role in ROLES if pools[role]},
        waiting={role: _total([s for s in current if s.role == role], "waiting")
                 for role in ROLES if pools[role]},
        workers=workers,
    )
