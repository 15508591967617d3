"""How many prompt tokens a step may carry while decodes run, so that those decodes keep
their time-per-output-token objective.

A step with B decodes and P prompt tokens takes about t_dec(B) + P·s_tok. With a TPOT
objective T the prompt tokens that fit are P = (T − t_dec(B)) / s_tok. Both costs are
measured from the steps this engine runs: decode-only steps give t_dec (a line through
recent (B, seconds) points), steps with prompt tokens give s_tok once t_dec is known. Until
both are measured no cap applies: a cold worker never guesses a budget.

T bounds each decode's time per output token as TPOT counts it: over its tokens so far, not
step by step (`step_allowance_s`). Decode-only steps faster than T save time that a later
step may spend on a larger prompt chunk. Where any step with prompt tokens has a large fixed
cost (a CPU dequantizing weight tiles for it), many small chunks would each pay it, and the
decodes would run near T on every step, where a few larger chunks keep their mean well under T.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

MIN_PROMPT_TOKENS_PER_STEP = 16  # a prompt always advances
UNREACHABLE_SHARE = 0.5  # of a decode step that prompt tokens may add once decodes alone exceed T
MAX_BANKED_OBJECTIVES = 4.0  # the longest step saved time may pay for, in objectives


class StepCosts:
    """Online estimates of t_dec(B) and s_tok from the engine's own steps."""

    def __init__(self, window: int = 64, alpha: float = 0.2):
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._alpha = alpha
        self.prefill_s_per_token: float | None = None

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds) or decodes + prompt_tokens <= 0:
            return
        if prompt_tokens == 0:
            self._decode_steps.append((decodes, seconds))
            return
        decode_part = self.decode_step_s(decodes) if decodes else 0.0
        if decode_part is None:
            return
        sample = max(seconds - decode_part, 0.0) / prompt_tokens
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
            return mean_t * max(decodes, 1) / max(mean_b, 1)
        slope = max(sum((b - mean_b) * (t - mean_t) for b, t in points) / var_b, 0.0)
        intercept = max(mean_t - slope * mean_b, 0.0)
        return intercept + slope * decodes


def step_allowance_s(tpot_objective_s: float, paces: Iterable[tuple[int, float]]) -> float:
    """The longest next step that keeps every running decode within the objective T over its
    tokens so far. `paces`: (tokens made since its first, seconds since its first) of each;
    one that made m tokens in e seconds may wait T·(m + 1) − e for its next. Never below T:
    a fresh decode, or one already behind, holds the step to T as step-by-step pacing would.
    Never above MAX_BANKED_OBJECTIVES·T: one step's stall stays bounded."""
    allowance = MAX_BANKED_OBJECTIVES * tpot_objective_s
    for tokens, seconds in paces:
        allowance = min(allowance, tpot_objective_s * (tokens + 1) - seconds)
    return max(allowance, tpot_objective_s)


def prefill_token_budget(tpot_objective_s: float | None, decodes: int, costs: StepCosts,
                         ceiling: int, floor: int = MIN_PROMPT_TOKENS_PER_STEP,
                         allowance_s: float | None = None) -> int:
    """Prompt tokens the next step may carry next to `decodes` running decodes, in a step of
    at most `allowance_s` (default: the objective itself; see `step_allowance_s`)."""
    if not tpot_objective_s or decodes == 0:
        return ceiling
    t_dec = costs.decode_step_s(decodes)
    s_tok = costs.prefill_s_per_token
    if t_dec is None or not s_tok:
        return ceiling
    fit = (max(allowance_s or 0.0, tpot_objective_s) - t_dec) / s_tok
    # decodes alone past the objective: it is lost either way, and starving prompts would
    # only trade it for unbounded time to first token; prompts may add half a decode step
    overloaded = UNREACHABLE_SHARE * t_dec / s_tok
    return int(min(max(fit, overloaded if fit <= 0 else 0, floor), ceiling))
