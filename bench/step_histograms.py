"""Engine step times as a Baton worker's /metrics reports them (`baton_step_seconds`,
`baton_step_prompt_tokens`, by kind of step: decode, mixed, prompt): how many ran, their
mean, and quantiles read off the histogram. A quantile is given as the upper bound of the
bucket it falls in ("at most"), which is all a histogram knows."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families


def histograms(text: str, name: str) -> dict[str, dict]:
    """kind -> {"buckets": [(upper bound, cumulative count)], "count", "sum"} of one histogram
    in Prometheus text, its label sets merged by `kind`."""
    found: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            entry = found.setdefault(sample.labels.get("kind", ""), {"buckets": {}, "count": 0.0, "sum": 0.0})
            if sample.name == name + "_bucket":
                bound = float(sample.labels["le"])
                entry["buckets"][bound] = entry["buckets"].get(bound, 0.0) + sample.value
            elif sample.name == name + "_count":
                entry["count"] += sample.value
            elif sample.name == name + "_sum":
                entry["sum"] += sample.value
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
    """Per kind of step with any steps: count, mean and p50/p90/p99 bounds in ms, the mean
    prompt tokens a step computed, and the time off the CPU within steps (its mean and p99
    bound: what other processes on the worker's core took from its steps)."""
    seconds = histograms(text, "baton_step_seconds")
    off_cpu = histograms(text, "baton_step_off_cpu_seconds")
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
        lost = off_cpu.get(kind, {})
        if lost.get("count"):
            row["off_cpu_mean_ms"] = round(1e3 * lost["sum"] / lost["count"], 2)
            row["off_cpu_p99_ms_at_most"] = 1e3 * bucket_quantile(lost["buckets"], 0.99)
        out[kind] = row
    return out
