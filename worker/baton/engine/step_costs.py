"""Online estimates of a worker's step costs, from the steps its engine runs: the decode
line t_dec(B), the prompt line F + s·P + a·W (W a chunk's attention work), and a step
beside decodes priced whole. step_budget.py sizes prompt chunks from them; the router reads
a worker's cost of a prompt token (`StepCosts.prefill_s_per_token`) from its state.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

CONTEXT_FIT_STEPS = 8  # prompt steps seen before their attention's share is fitted (three unknowns, noisy steps)
# Budgets keep in hand this quantile of how far prompt steps ran past the fitted line. On two
# colocated workers of a Xeon with AMX (vLLM's client, bench/serving.py) the steps with a
# prompt chunk, sized by the line alone, ran to 56-65 ms under a 50 ms objective: their cost
# also depends on how many decodes ride along, which the line does not see.
MARGIN_QUANTILE = 0.9
# Steps beside decodes seen before they are priced whole (`StepCosts.chunk_step_cost`): the
# steps a budget sizes, twice the prompt line's count, as two more unknowns come from them.
CHUNK_LINE_STEPS = 16
# The prompt steps a worker's cost of a prompt token is taken over: their added seconds over
# their tokens. Smoothed step by step instead (a weight of 0.2 each), one step's sample of
# ~2.2 ms a token (a chunk of a few tokens a few ms off the decode line gives one) moved it
# 0.2 -> 0.6 ms a token on a Xeon core, and the router had kept prompts at that decode worker
# while it read 0.2 (bench/serving.py).
RATE_STEPS = 16


def attention_work(start: int, tokens: int) -> int:
    """A prompt chunk's rows x the context each attends over: tokens start..start+tokens-1,
    each over every position up to its own."""
    return tokens * start + tokens * (tokens + 1) // 2


class PromptCost(NamedTuple):
    """A step's prompt chunks cost F + s·P + a·W seconds beyond its decodes, W their
    attention work (`attention_work`): a chunk late in a long prompt attends over more."""

    fixed: float
    per_token: float
    per_context: float = 0.0
    # how far recent steps ran past the line (its MARGIN_QUANTILE): budgets keep it in hand,
    # so that most steps, not the average one, end within the objective
    margin: float = 0.0

    def seconds(self, tokens: float, start: int = 0) -> float:
        return self.fixed + self.per_token * tokens + self.per_context * (tokens * start + tokens * (tokens + 1) / 2)

    def marginal(self, start: int = 0) -> float:
        """About what one more token costs in a chunk starting at `start`."""
        return self.per_token + self.per_context * (start + 0.5)

    def tokens_within(self, seconds: float, start: int = 0) -> float:
        """The chunk at `start` whose tokens cost `seconds` beyond F and the margin (negative
        past them)."""
        room, linear, square = seconds - self.fixed - self.margin, self.marginal(start), self.per_context / 2
        if room <= 0 or square <= 0:
            return room / linear
        # the root of square·x² + linear·x = room in the form that stays exact as square -> 0
        # (with a near-zero fitted context cost the textbook form's difference is all rounding:
        # 72 tokens where 40 fit)
        return 2 * room / (linear + math.sqrt(linear * linear + 4 * square * room))


class PromptStep(NamedTuple):
    """One measured step with prompt tokens: its tokens, their attention work
    (`attention_work`), the seconds beyond its decodes' own cost, its decodes, its seconds."""

    tokens: int
    work: int
    extra: float
    decodes: int
    seconds: float


class StepCosts:
    """Online estimates of t_dec(B) and of prompt chunks' cost from the engine's own steps."""

    def __init__(self, window: int = 64):
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._prompt_steps: deque[PromptStep] = deque(maxlen=window)
        self._rate_steps: deque[tuple[float, int]] = deque(maxlen=RATE_STEPS)  # (added seconds, prompt tokens)

    @property
    def prefill_s_per_token(self) -> float | None:
        """What a prompt token costs here: the seconds prompt tokens added to the last
        RATE_STEPS steps that carried them, over those tokens (None before one is seen)."""
        steps = tuple(self._rate_steps)  # a snapshot: the state answers from another thread
        tokens = sum(n for _, n in steps)
        return sum(extra for extra, _ in steps) / tokens if tokens else None

    def forget_prefill_rate(self) -> None:
        self._rate_steps.clear()

    def observe(self, decodes: int, prompt_tokens: int, seconds: float, work: int | None = None) -> None:
        """A step's decodes, prompt tokens and seconds; `work`: its chunks' attention work
        (default: a fresh prompt's, attention_work(0, prompt_tokens))."""
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
        self._prompt_steps.append(PromptStep(prompt_tokens, attention_work(0, prompt_tokens) if work is None else work,
                                             extra, decodes, seconds))
        if extra <= 0:
            # a step no longer than the decode line's fixed part (a few prompt tokens, with
            # the line known from other steps) says nothing of a token's cost: a rate of zero
            # would tell the router prompts are free here
            return
        self._rate_steps.append((extra, prompt_tokens))

    def keep_median_prompt_steps(self) -> None:
        """Of prompt steps alike (the same tokens, attention work and decodes), the median one,
        as often as they ran: calibration's repeated steps, a point per size that one slow
        step (a neighbour taking the core) does not move, enough for the fit with context."""
        alike: dict[tuple[int, int, int], list[PromptStep]] = {}
        for step in self._prompt_steps:
            alike.setdefault((step.tokens, step.work, step.decodes), []).append(step)
        kept = [sorted(steps, key=lambda s: s.seconds)[(len(steps) - 1) // 2] for steps in alike.values()
                for _ in steps]
        self._prompt_steps = deque(kept, maxlen=self._prompt_steps.maxlen)

    def forget_prompt_steps(self) -> None:
        self._prompt_steps.clear()

    def forget_decode_steps(self) -> None:
        """Drop the decode-only steps seen (a worker that will not decode: its prompt steps
        then count whole, the step's own overhead included)."""
        self._decode_steps.clear()

    def decode_step_s(self, decodes: int) -> float | None:
        """t_dec(B): least squares over the median step of each batch size seen (weighted
        by its steps), never below zero; with a single batch size seen, its median scaled
        by B (an over-estimate for larger B, which errs towards smaller prompt chunks).
        Medians, because one slow step (a neighbour process taking the core, a page fault)
        among a few at one size tilted the line: calibration on a busy 2-core machine
        once measured one stream as slow as four, and the flat fit priced eight decodes
        as one. Read from a snapshot: a worker's state answers from another thread than the
        engine's, whose steps append to the window meanwhile."""
        line = self.decode_step_line()
        return None if line is None else line[0] + line[1] * decodes

    def decode_step_line(self) -> tuple[float, float] | None:
        """decode_step_s's line as (intercept, seconds per decode); None before any decode step."""
        by_batch: dict[int, list[float]] = {}
        for b, t in tuple(self._decode_steps):
            by_batch.setdefault(b, []).append(t)
        if not by_batch:
            return None
        points = [(b, statistics.median(ts), len(ts)) for b, ts in by_batch.items()]
        n = sum(w for _, _, w in points)
        mean_b = sum(b * w for b, _, w in points) / n
        mean_t = sum(t * w for _, t, w in points) / n
        if len(points) == 1:
            return 0.0, mean_t / max(mean_b, 1)
        var_b = sum(w * (b - mean_b) ** 2 for b, _, w in points)
        slope = max(sum(w * (b - mean_b) * (t - mean_t) for b, t, w in points) / var_b, 0.0)
        return max(mean_t - slope * mean_b, 0.0), slope

    def prompt_cost(self) -> PromptCost | None:
        """F + s·P + a·W: least squares over recent steps, all three where the steps tell
        them apart (a > 0, F ≥ 0), else (F, s) with a = 0 and F ≥ 0. Chunks all of about one
        size cannot tell F from s: then F = 0 (every second per token, an over-estimate for
        larger chunks). Once CONTEXT_FIT_STEPS steps are in, with the margin those steps ran
        past the fit (its MARGIN_QUANTILE): over the steps beside decodes where there are that
        many, as those are the steps a budget sizes. None before any step, or where they added
        nothing measurable to their decodes' (a tiny model's: no token is free)."""
        steps = [(p, w, t) for p, w, t, _, _ in self._prompt_steps]
        if not steps:
            return None
        cost = _fit_with_context(steps) or _fit_line([(p, t) for p, _, t in steps])
        if not cost.per_token > 0:
            return None
        if len(steps) < CONTEXT_FIT_STEPS:
            return cost
        # A colocated worker's steps with no decodes carry whole prompts, several at a time
        # (hundreds of milliseconds), and stray from the line by more in absolute terms. On two
        # colocated workers of a Xeon with AMX (bench/serving.py) they set the margin of the
        # worker that ran them at 8-17 ms (1.4-5.7 ms judged beside decodes), and that worker,
        # left with one stream and three prompts waiting, ran 15-31-token chunks in 18-25 ms
        # steps under a 35 ms objective.
        sized = [(p, w, t) for p, w, t, decodes, _ in self._prompt_steps if decodes]
        judged = sized if len(sized) >= CONTEXT_FIT_STEPS else steps
        return cost._replace(margin=_margin(t - cost.fixed - cost.per_token * p - cost.per_context * w
                                            for p, w, t in judged))

    def chunk_step_cost(self, decodes: int, cost: PromptCost) -> PromptCost | None:
        """A whole step of prompt chunks beside `decodes` decodes, G + d·B + s·P + a·W, with its
        own margin: s and a are the prompt line's (`cost`), G and d are fitted on the steps
        beside decodes once CHUNK_LINE_STEPS are in (None before). The prompt line prices such
        a step as t_dec(B) + F + s·P + a·W, the decodes at what they cost in decode-only
        steps; where the step's products take every row in one pass, they ride it nearly
        free. On two colocated workers of a Xeon with AMX (bench/serving.py) a step beside
        decodes took 20.6 ms + 0.06 ms a decode + 0.218 ms a prompt token (a direct fit); the
        line priced steps beside two decodes late in a prompt 4-8 ms high, and their chunks
        stopped at 14 tokens in 23-26 ms steps under a 35 ms objective. d stays within
        [0, what a decode costs in decode-only steps] (that bound itself where every step
        had the same decodes) and G ≥ 0: a fit of all four parts on calibration's few steps
        once gave a per-token cost near zero and an uncapped budget."""
        sized = [(p, w, b, seconds) for p, w, _, b, seconds in self._prompt_steps if b]
        if len(sized) < CHUNK_LINE_STEPS:
            return None
        one, two = self.decode_step_s(1), self.decode_step_s(2)
        if one is None or two is None:
            return None
        rest = np.asarray([seconds - cost.per_token * p - cost.per_context * w for p, w, _, seconds in sized])
        batch = np.asarray([b for _, _, b, _ in sized], dtype=np.float64)
        spread = batch - batch.mean()
        # with one batch size seen the steps cannot tell d: the decode line's, as the prompt
        # line prices decodes (smaller chunks beside more decodes than were seen, not larger)
        most = max(two - one, 0.0)
        slope = float(spread @ (rest - rest.mean()) / (spread @ spread)) if spread.any() else most
        per_decode = min(max(slope, 0.0), most)
        base = max(float(rest.mean()) - per_decode * float(batch.mean()), 0.0)
        return PromptCost(base + per_decode * decodes, cost.per_token, cost.per_context,
                          _margin((rest - base - per_decode * batch).tolist()))


def _margin(past: Iterable[float]) -> float:
    """How far steps ran past a cost line, kept in hand by budgets: its MARGIN_QUANTILE, ≥ 0."""
    ordered = sorted(past)
    return max(0.0, float(ordered[int(MARGIN_QUANTILE * (len(ordered) - 1))]))


def _fit_line(points: list[tuple[int, float]]) -> PromptCost:
    """(F, s) by least squares over (P, seconds) with F ≥ 0."""
    total_p = sum(p for p, _ in points)
    through_origin = sum(p * t for p, t in points) / sum(p * p for p, _ in points)
    n = len(points)
    mean_p, mean_t = total_p / n, sum(t for _, t in points) / n
    var_p = sum((p - mean_p) ** 2 for p, _ in points)
    if var_p <= (0.1 * mean_p) ** 2 * n:
        return PromptCost(0.0, through_origin)
    slope = sum((p - mean_p) * (t - mean_t) for p, t in points) / var_p
    fixed = mean_t - slope * mean_p
    if slope <= 0 or fixed < 0:
        return PromptCost(0.0, through_origin)
    return PromptCost(fixed, slope)


def _fit_with_context(steps: list[tuple[int, int, float]]) -> PromptCost | None:
    """F, s, a by least squares, or None where the steps do not tell them apart or give
    a negative part (the columns scaled, so the check is on their shapes, not their units)."""
    if len(steps) < CONTEXT_FIT_STEPS:
        return None
    rows = np.asarray(steps, dtype=np.float64)
    columns = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
    scale = np.abs(columns).max(axis=0)
    if np.any(scale == 0):
        return None
    scaled = columns / scale
    tolerance = 1e-3 * np.sqrt(len(rows))
    fixed = -1.0
    if np.linalg.matrix_rank(scaled, tol=tolerance) == 3:
        solution = np.linalg.lstsq(scaled, rows[:, 2], rcond=None)[0] / scale
        fixed, per_token, per_context = (float(v) for v in solution)
    if fixed < 0:
        # chunks of one size (F cannot be told from s), or a negative F: F = 0, as in the
        # fit without context
        if np.linalg.matrix_rank(scaled[:, 1:], tol=tolerance) < 2:
            return None
        per_token, per_context = (float(v) for v in np.linalg.lstsq(scaled[:, 1:], rows[:, 2], rcond=None)[0]
                                  / scale[1:])
        fixed = 0.0
    if per_token <= 0 or per_context <= 0:
        return None
    return PromptCost(fixed, per_token, per_context)
