"""The router's recent placement decisions and what each was made of (pure; no I/O).

A prompt is prefilled where it decodes (local) or on a prefill worker (remote) by comparing
its uncached tokens with a threshold that moves with load (threshold.py). When a run sends
more prompts one way than expected, the answer lies in the threshold each prompt met and
the terms behind it: the streams a local prefill would stall, the prefill queue, the prompts
a remote one would hold up, and the estimates of the moment. The router keeps the last
PLACEMENTS_KEPT decisions in memory and serves them at `/router/placements`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

PLACEMENTS_KEPT = 512  # ~0.5 KB each


@dataclass(frozen=True)
class Placement:
    at: float  # seconds since the epoch
    request_id: str
    prompt_tokens: int
    uncached_tokens: int
    path: str  # local | remote
    threshold_tokens: float  # inf: every prompt stays home
    decode_worker: str
    prefill_worker: str | None  # the best prefill worker when the choice was made (None: none)
    terms: dict = field(default_factory=dict)  # the threshold's load terms (ThresholdEstimator.threshold's arguments)
    estimates: dict = field(default_factory=dict)  # the estimator's inputs then (ThresholdEstimator.explain)
    fallback: bool = False  # local because the remote path failed (the decision before it is recorded too)

    def as_json(self) -> dict:
        """JSON-safe: an infinite or unknown number is null."""
        return {"at": round(self.at, 3), "request_id": self.request_id, "prompt_tokens": self.prompt_tokens,
                "uncached_tokens": self.uncached_tokens, "path": self.path,
                "threshold_tokens": _number(self.threshold_tokens), "decode_worker": self.decode_worker,
                "prefill_worker": self.prefill_worker,
                "terms": {k: _number(v) for k, v in self.terms.items()},
                "estimates": {k: v if isinstance(v, str) else _number(v) for k, v in self.estimates.items()},
                "fallback": self.fallback}


def _number(value: float | int | None) -> float | int | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return value if isinstance(value, int) else float(f"{value:.6g}")


class PlacementLog:
    """The last `kept` placements, oldest first, and how many were made in all."""

    def __init__(self, kept: int = PLACEMENTS_KEPT):
        if kept < 1:
            raise ValueError(f"a placement log keeps at least 1 decision, got {kept}")
        self._recent: deque[Placement] = deque(maxlen=kept)
        self.total = 0

    def record(self, placement: Placement) -> None:
        self._recent.append(placement)
        self.total += 1

    def recent(self, limit: int | None = None) -> list[Placement]:
        """The last `limit` placements (all kept where None), oldest first."""
        kept = list(self._recent)
        return kept if limit is None else kept[max(len(kept) - limit, 0):]


def placement_summary(placements: list[Placement]) -> dict:
    """How many went each way by the threshold, how many fell back to local when the remote
    path failed, how many had no prefill worker to choose (local whatever the threshold), and
    the thresholds the others met: the least, median and most of the finite ones, and how many
    were infinite (the remote path's cost outweighed any length)."""
    decided = [p for p in placements if not p.fallback]
    chosen = [p for p in decided if p.prefill_worker is not None]
    finite = [p.threshold_tokens for p in chosen if math.isfinite(p.threshold_tokens)]
    summary = {"placements": len(decided),
               "local": sum(p.path == "local" for p in decided),
               "remote": sum(p.path == "remote" for p in decided),
               "fell_back_local": len(placements) - len(decided),
               "without_prefill_worker": len(decided) - len(chosen),
               "infinite_thresholds": len(chosen) - len(finite)}
    if finite:
        summary["threshold_tokens"] = {"min": _number(min(finite)), "median": _number(statistics.median(finite)),
                                       "max": _number(max(finite))}
    return summary
