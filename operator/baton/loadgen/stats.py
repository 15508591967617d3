"""Latency and goodput statistics, with `vllm bench serve`'s definitions (pure).

TTFT: request start to the first streamed token. TPOT: (E2E − TTFT) / (output tokens − 1),
per request with more than one token. ITL: every gap between consecutive streamed chunks,
pooled over requests. Goodput: completed requests per second that met every SLO given.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    kind: str  # dataset label, e.g. "short" / "long"
    prompt_len: int
    start: float  # seconds since the run began
    success: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # seconds since `start`

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        checks = ((self.ttft, r.ttft), (self.tpot, r.tpot), (self.e2e, r.e2e))
        return r.success and all(limit is None or (value is not None and value <= limit)
                                 for limit, value in checks)


def parse_duration(text: str) -> float:
    text = text.strip().lower()
    for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def parse_slo(text: str | None) -> Slo:
    """`ttft=2s,tpot=100ms,e2e=30s` (any subset)."""
    if not text:
        return Slo()
    values: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in ("ttft", "tpot", "e2e", "e2el"):
            raise ValueError(f"unknown SLO {key!r}: use ttft, tpot or e2e")
        values["e2e" if key == "e2el" else key] = parse_duration(value)
    return Slo(**values)


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean, median, std and the percentiles, in milliseconds (None when empty)."""
    if not values:
        return {"mean_ms": None, "median_ms": None, "std_ms": None,
                **{f"p{p}_ms": None for p in PERCENTILES}}
    ordered = sorted(values)
    out = {"mean_ms": 1e3 * statistics.fmean(ordered), "median_ms": 1e3 * statistics.median(ordered),
           "std_ms": 1e3 * (statistics.pstdev(ordered) if len(ordered) > 1 else 0.0)}
    for p in PERCENTILES:
        out[f"p{p}_ms"] = 1e3 * percentile(ordered, p)
    return out


def percentile(ordered: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo = Slo(),
              kind: str | None = None) -> dict:
    chosen = [r for r in records if kind is None or r.kind == kind]
    done = [r for r in chosen if r.success]
    duration_s = max(duration_s, 1e-9)
    output = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if slo.met_by(r))
    return {
        "requests": len(chosen), "completed": len(done), "failed": len(chosen) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (output + sum(r.prompt_len for r in done)) / duration_s,
        "total_output_tokens": output,
        "goodput": good / duration_s if any(v is not None for v in (slo.ttft, slo.tpot, slo.e2e)) else None,
        "slo_attainment": good / len(done) if done else None,
        "ttft": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl": distribution([gap for r in done for gap in r.itls]),
        "e2e": distribution([r.e2e for r in done if r.e2e is not None]),
    }
