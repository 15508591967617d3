"""How many prompt tokens a step may carry while decodes run, so that those decodes keep
their time-per-output-token objective.

A step with B decodes and P prompt tokens takes about t_dec(B) + g(P), g(P) = F + s·P. In a
step of at most A seconds the prompt tokens that fit are P = (A − t_dec(B) − F) / s. Both
costs are measured from the steps this engine runs: decode-only steps give t_dec (a line
through recent (B, seconds) points), steps with prompt tokens give g (a line through recent
(P, seconds beyond t_dec) points) once t_dec is known. Until both are measured no cap
applies: a cold worker never guesses a budget.

T bounds each decode's time per output token as TPOT counts it: over its tokens so far, not
step by step (`step_allowance_s`). Decode-only steps faster than T save time that a later
step may spend on a larger prompt chunk, up to `bank` objectives; by default one, so that no
step runs past T and each gap between tokens stays within it (DEFAULT_BANK_OBJECTIVES). Where any step with prompt tokens has a large fixed
cost (a CPU dequantizing weight tiles for it), many small chunks would each pay it, and the
decodes would run near T on every step, where a few larger chunks keep their mean well under T.
So the prompt cost is fitted as a line, g(P) = F + s·P, and while what fits now is a chunk
too small to be worth its fixed part F, the prompt waits a step or two (decode-only steps
refill what the decodes have saved) and then runs in one worthwhile chunk. A is the
objective T itself for a decode that has saved nothing.

On a prefill worker (no decodes; every prompt handed off at the end of its step) the same
fit sizes how many prompts start and finish together: until F is a tenth of the step
(`prompt_batch_tokens`), not up to the whole per-step budget, since every prompt finishing
in a step waits for its end. A long prompt's chunks are outside the limit and short prompts
ride beside them (counting the chunks held both back, and the interference benchmark's P/D
setup doubled its long TTFT). A colocated worker's prompts decode where they are, and there
one large step that starts them all together did better (the interference benchmark's
chunked setup lost a third of its throughput under the limit).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

MIN_PROMPT_TOKENS_PER_STEP = 16  # a prompt always advances
UNREACHABLE_SHARE = 0.5  # of a decode step that prompt tokens may add once decodes alone exceed T
# The longest step that saved time may pay for, in objectives. 1: no step runs past T, so
# every gap between a stream's tokens stays within it (a prompt's chunks are smaller and its
# first token later). Measured with vLLM's serving client (bench/serving.py, a Xeon with AMX,
# two colocated workers): banking 4 objectives of 100 ms let a 256-token prompt run whole
# beside four decodes, a 125 ms gap at p99 (2.46x vLLM's); 1 objective of 50 ms gave 58 ms.
DEFAULT_BANK_OBJECTIVES = 1.0
BATCH_FIXED_SHARE = 0.1  # with no decodes, prompts batch until a step's fixed cost is this share of it


class StepCosts:
    """Online estimates of t_dec(B) and s_tok from the engine's own steps."""

    def __init__(self, window: int = 64, alpha: float = 0.2):
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._prompt_steps: deque[tuple[int, float]] = deque(maxlen=window)  # (P, seconds beyond decodes)
        self._alpha = alpha
        self.prefill_s_per_token: float | None = None  # smoothed mean: what a local prompt token costs

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds) or decodes + prompt_tokens <= 0:
            return
        if prompt_tokens == 0:
            self._decode_steps.append((decodes, seconds))
            return
        # the step's own overhead too (t_dec(0), the line's intercept): g(P) is what the
        # prompt tokens add to a step that would run anyway
        decode_part = self.decode_step_s(decodes) if decodes or self._decode_steps else 0.0
        if decode_part is None:
            return
        extra = max(seconds - decode_part, 0.0)
        self._prompt_steps.append((prompt_tokens, extra))
        sample = extra / prompt_tokens
        old = self.prefill_s_per_token
        self.prefill_s_per_token = sample if old is None else (1 - self._alpha) * old + self._alpha * sample

    def decode_step_s(self, decodes: int) -> float | None:
        """t_dec(B): least squares over recent decode-only steps, never below zero; with a
        single batch size seen, that size's mean scaled by B (an over-estimate for larger B,
        which errs towards smaller prompt chunks)."""
        points = list(self._decode_steps)
        if not points:
            return None
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        var_b = sum((b - mean_b) ** 2 for b, _ in points)
        if var_b < 1e-9:
            return mean_t * decodes / max(mean_b, 1)
        slope = max(sum((b - mean_b) * (t - mean_t) for b, t in points) / var_b, 0.0)
        intercept = max(mean_t - slope * mean_b, 0.0)
        return intercept + slope * decodes

    def prompt_cost(self) -> tuple[float, float] | None:
        """(F, s): a step's prompt tokens cost F + s·P seconds beyond its decodes; least
        squares over recent steps with F ≥ 0. Chunks all of about one size cannot tell F
        from s: then F = 0 (every second per token, an over-estimate for larger chunks)."""
        points = list(self._prompt_steps)
        if not points:
            return None
        total_p = sum(p for p, _ in points)
        through_origin = sum(p * t for p, t in points) / sum(p * p for p, _ in points)
        n = len(points)
        mean_p, mean_t = total_p / n, sum(t for _, t in points) / n
        var_p = sum((p - mean_p) ** 2 for p, _ in points)
        if var_p <= (0.1 * mean_p) ** 2 * n:
            return 0.0, through_origin
        slope = sum((p - mean_p) * (t - mean_t) for p, t in points) / var_p
        fixed = mean_t - slope * mean_p
        if slope <= 0 or fixed < 0:
            return 0.0, through_origin
        return fixed, slope


def step_allowance_s(tpot_objective_s: float, paces: Iterable[tuple[int, float]],
                     bank: float = DEFAULT_BANK_OBJECTIVES) -> float:
    """The longest next step that keeps every running decode within the objective T over its
    tokens so far. `paces`: (tokens made since its first, seconds since its first) of each;
    one that made m tokens in e seconds may wait T·(m + 1) − e for its next. Never below T:
    a fresh decode, or one already behind, holds the step to T as step-by-step pacing would.
    Never above bank·T (`bank` objectives): one step's stall stays bounded."""
    allowance = bank * tpot_objective_s
    for tokens, seconds in paces:
        allowance = min(allowance, tpot_objective_s * (tokens + 1) - seconds)
    return max(allowance, tpot_objective_s)


def prompt_batch_tokens(costs: StepCosts, ceiling: int, least: int) -> int:
    """Tokens of prompts a step with no decodes may start and finish: enough that its fixed
    cost F is at most BATCH_FIXED_SHARE of the step, and no more. Every prompt of a step gets its first
    token at the step's end, so a bigger batch gains a few percent of throughput and delays
    its first prompts by the whole of it: prompts arriving together at a prefill worker ran
    as one long step, were then decoded in step, finished together and came back together,
    wave after wave, the prefill worker idle between waves. `least`: the smallest step worth
    having (a chunk); `ceiling` until the costs are measured."""
    cost = costs.prompt_cost()
    if cost is None:
        return ceiling
    fixed, per_token = cost
    share = BATCH_FIXED_SHARE
    tokens = math.ceil(fixed * (1 - share) / (share * per_token))
    return int(min(max(tokens, least, 1), ceiling))


def prefill_token_budget(tpot_objective_s: float | None, decodes: int, costs: StepCosts,
                         ceiling: int, floor: int = MIN_PROMPT_TOKENS_PER_STEP,
                         allowance_s: float | None = None, wanted: int | None = None,
                         deferred_s: float = 0.0, bank: float = DEFAULT_BANK_OBJECTIVES) -> int:
    """Prompt tokens the next step may carry next to `decodes` running decodes, in a step of
    at most `allowance_s` (default: the objective itself; see `step_allowance_s`). `wanted`:
    the prompt tokens waiting; `deferred_s`: how long they have waited for a worthwhile
    chunk. 0 means wait: decode-only steps first, then a chunk worth its fixed cost; never
    longer than the longest allowed step (fresh decodes, which have saved nothing yet, could
    otherwise hold prompts back step after step)."""
    if not tpot_objective_s or decodes == 0:
        return ceiling
    t_dec = costs.decode_step_s(decodes)
    cost = costs.prompt_cost()
    if t_dec is None or cost is None:
        return ceiling
    fixed, per_token = cost

    def fit(seconds: float) -> float:
        return (seconds - t_dec - fixed) / per_token

    most = fit(bank * tpot_objective_s)  # what the longest allowed step holds
    if most < floor:
        # decodes alone (nearly) past the objective: it is lost either way, and starving
        # prompts would only trade it for unbounded time to first token; prompts may add
        # half a decode step
        return int(min(max(UNREACHABLE_SHARE * t_dec / per_token, floor), ceiling))
    now = fit(min(max(allowance_s or 0.0, tpot_objective_s), bank * tpot_objective_s))
    # a chunk whose fixed part is at most a third of its cost; less is worth waiting for
    worthwhile = min(2 * fixed / per_token, most, wanted if wanted is not None else ceiling, ceiling)
    if now < worthwhile and deferred_s < bank * tpot_objective_s:
        return 0
    return int(min(max(now, floor), ceiling))
