"""Engine step times as a Baton worker's /metrics reports them (`baton_step_seconds`,
`baton_step_prompt_tokens`, by kind of step: decode, mixed, prompt): how many ran, their
mean, and quantiles read off the histogram. A quantile is given as the upper bound of the
bucket it falls in ("at most"), which is all a histogram knows."""

from __future__ import annotations

import math


def histograms(text: str, name: str) -> dict[str, dict]:
    """kind -> {"buckets": [(upper bound, cumulative count)], "count", "sum"} of one histogram
    in Prometheus text, its label sets merged by `kind`."""
    found: dict[str, dict] = {}
    for line in text.splitlines():
        if not line.startswith(name + "_") or "{" not in line:
            continue
        series, labels = line.split("{", 1)[0], line.split("{", 1)[1].rsplit("}", 1)[0]
        pairs = dict(p.split("=", 1) for p in labels.split(",") if "=" in p)
        kind = pairs.get("kind", '""').strip('"')
        value = float(line.rsplit(" ", 1)[1])
        entry = found.setdefault(kind, {"buckets": {}, "count": 0.0, "sum": 0.0})
        if series == name + "_bucket":
            bound = float(pairs["le"].strip('"'))
            entry["buckets"][bound] = entry["buckets"].get(bound, 0.0) + value
        elif series == name + "_count":
            entry["count"] += value
        elif series == name + "_sum":
            entry["sum"] += value
    for entry in found.values():
        entry["buckets"] = sorted(entry["buckets"].items())
    return found


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The upper bound of the bucket that holds the q-quantile (inf past the last finite one)."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    for bound, cumulative in buckets:
        if cumulative >= q * total:
            return bound
    return math.inf


def step_summary(text: str) -> dict[str, dict]:
    """Per kind of step with any steps: count, mean and p50/p90/p99 bounds in ms, and the
    mean prompt tokens a step computed."""
    seconds = histograms(text, "baton_step_seconds")
    tokens = histograms(text, "baton_step_prompt_tokens")
    out = {}
    for kind, entry in sorted(seconds.items()):
        if not entry["count"]:
            continue
        row = {"steps": int(entry["count"]), "mean_ms": round(1e3 * entry["sum"] / entry["count"], 2)}
        for q in (0.5, 0.9, 0.99):
            row[f"p{round(q * 100)}_ms_at_most"] = 1e3 * bucket_quantile(entry["buckets"], q)
        if tokens.get(kind, {}).get("count"):
            row["mean_prompt_tokens"] = round(tokens[kind]["sum"] / tokens[kind]["count"], 1)
        out[kind] = row
    return out
