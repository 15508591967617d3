"""Whether a decode worker holds its next step for a prompt whose KV is about to arrive.

A prompt prefilled elsewhere joins the batch at the first step boundary after its commit.
A commit that lands just after a step began waits out that step, then runs one: its first
gap is up to two steps, against one for every other token. The KV streams in layer by
layer while the prefill computes, so the decode worker can see a commit coming: when the
last layers are due within part of a step, it waits for them before starting the step.
Holding up to half a step at a boundary bounds both sides at 1.5 steps: the newcomer's
first gap (a commit due later is at most half a step into the step it misses), and the
gaps of the streams held (pure functions; AsyncEngine waits, server/intake.py reports).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# A forecast this many layer-times overdue is stale (the sender stalled, or a route's
# other ranks are slower): holding on it would only spend the budget.
STALE_LAYERS = 2.0
POLL_S = 0.001  # how long an overdue commit is waited for at a time
# Holds may take about this share of a decode worker's time, no more: each spares one stream
# half a step and costs every running stream the wait, so a steady flow of prompts arriving
# must not hold every step (its decodes would run up to a third slower).
MAX_HOLD_SHARE = 0.1


@dataclass(frozen=True)
class Arrival:
    """One prompt's KV arriving here: its layers in so far, with the times of the first
    and the latest (monotonic seconds), and whether its commit is already queued."""

    layers_done: int
    num_layers: int
    first_at: float | None
    last_at: float | None
    committing: bool = False


def expected_in(arrival: Arrival, now: float) -> float | None:
    """Seconds until the arrival's commit, from the pace of its layers so far: the layers to
    come, then about one more layer's time for the prefill's last norm, LM head, sampling
    and END. 0: due now or overdue; None: no forecast (under two layers in, or stale)."""
    if arrival.committing:
        return 0.0
    done = arrival.layers_done
    if done < 2 or arrival.first_at is None or arrival.last_at is None:
        return None
    per_layer = max(arrival.last_at - arrival.first_at, 0.0) / (done - 1)
    due = arrival.last_at + (arrival.num_layers - done + 1) * per_layer
    if now - due > STALE_LAYERS * per_layer:
        return None
    return max(due - now, 0.0)


def hold_s(arrivals: Iterable[Arrival], now: float, budget_s: float) -> float:
    """How long to wait before the next step: until the soonest commit due within
    `budget_s` (at least POLL_S for one due now), or 0 to step at once."""
    if budget_s <= 0:
        return 0.0
    due = [eta for a in arrivals if (eta := expected_in(a, now)) is not None and eta <= budget_s]
    if not due:
        return 0.0
    return min(max(min(due), POLL_S), budget_s)


def may_hold(recent_hold_s: float, recent_step_s: float) -> bool:
    """Whether holds are within their share: `recent_hold_s` is the moving average of the
    time held before each step, `recent_step_s` that of the steps."""
    return recent_hold_s <= MAX_HOLD_SHARE * recent_step_s
