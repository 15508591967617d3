"""Reading the few worker counters the auto threshold needs (pure: text in, numbers out)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# sample name -> key; counters are summed over their labels
WANTED = {
    "baton_prefill_busy_seconds_total": "prefill_busy_s",
    "baton_prompt_tokens_total": "prompt_tokens",
}


def parse_worker_counters(text: str) -> dict[str, float]:
    totals = dict.fromkeys(WANTED.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = WANTED.get(sample.name)
            if key is not None:
                totals[key] += float(sample.value)
    return totals


def counter_deltas(previous: dict[str, float] | None, current: dict[str, float]) -> dict[str, float]:
    """Growth since the last scrape; a counter that went down (worker restarted) counts from 0."""
    if previous is None:
        return dict.fromkeys(current, 0.0)
    return {k: (v - previous.get(k, 0.0)) if v >= previous.get(k, 0.0) else v for k, v in current.items()}
