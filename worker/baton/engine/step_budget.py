"""How many prompt tokens a step may carry while decodes run, so that those decodes keep
their time-per-output-token objective.

A step with B decodes and P prompt tokens takes about t_dec(B) + g(P), g(P) = F + s·P. In a
step of at most A seconds the prompt tokens that fit are P = (A − t_dec(B) − F) / s. Both
costs are measured from the steps this engine runs: decode-only steps give t_dec (a line
through recent (B, seconds) points), steps with prompt tokens give g (a line through recent
(P, seconds beyond t_dec) points) once t_dec is known. Until both are measured no cap
applies: a cold worker never guesses a budget (and a worker measures both before it serves,
engine/calibration.py). Once enough steps beside decodes are measured, such a step is priced
whole instead, G + d·B + g's per-token parts (`StepCosts.chunk_step_cost`): where one pass
over the weights takes every row, decodes ride a prompt chunk's step for far less than t_dec.

T bounds each decode's time per output token as TPOT counts it: over its tokens so far, not
step by step (`step_allowance_s`). Decode-only steps faster than T save time that a later
step may spend on a larger prompt chunk, up to `bank` objectives: on a decode worker one by
default, so that no step runs past T and each gap between tokens stays within it
(DEFAULT_BANK_OBJECTIVES); on a colocated worker up to 1.4 (COLOCATED_BANK_OBJECTIVES), as
far as leaves prompt chunks a worthwhile share of the step beside its decodes
(`colocated_bank`), each stream starting with some time already saved (STARTING_CREDIT_STEPS). Where any step with prompt
tokens has a large fixed cost (a CPU dequantizing weight tiles for it), many small chunks would each pay it, and the
decodes would run near T on every step, where a few larger chunks keep their mean well under T.
So the prompt cost is fitted as a line, g(P) = F + s·P, and while what fits now is a chunk
too small to be worth its fixed part F, the prompt waits a step or two (decode-only steps
refill what the decodes have saved) and then runs in one worthwhile chunk. A is the
objective T itself for a decode that has saved nothing.

On a prefill worker (no decodes; every prompt handed off at the end of its step) the same
fit sizes how many prompts start and finish together: only while their work is less than F
(`prompt_batch_tokens`), not up to the whole per-step budget, since every prompt finishing
in a step waits for its end. A long prompt's chunks are outside the limit and short prompts
ride beside them (counting the chunks held both back, and the interference benchmark's P/D
setup doubled its long TTFT). A colocated worker's prompts decode where they are, and there
one large step that starts them all together did better (the interference benchmark's
chunked setup lost a third of its throughput under the limit).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

# A prompt always advances by this much, past the objective if need be. At 16, the floor set a
# P/D decode worker's chunk steps (beside six decodes ~33 ms whatever the objective): with 8,
# a 30 ms objective gave ITL p99 36.8-43.1 ms against 41.9-44.1 at 16 (Zen 4, bench/serving.py,
# 4 and 2 rounds), TTFT and throughput alike.
MIN_PROMPT_TOKENS_PER_STEP = 8
FINISHING_SLACK_TOKENS = 16  # a prompt's last tokens past what fits that may end it now, without row tiles
UNREACHABLE_SHARE = 0.5  # of a decode step that prompt tokens may add once decodes alone exceed T
# The longest step that saved time may pay for, in objectives. 1: no step runs past T, so
# every gap between a stream's tokens stays within it (a prompt's chunks are smaller and its
# first token later). Measured with vLLM's serving client (bench/serving.py, a Xeon with AMX,
# two colocated workers): banking 4 objectives of 100 ms let a 256-token prompt run whole
# beside four decodes, a 125 ms gap at p99 (2.46x vLLM's); 1 objective of 50 ms gave 58 ms.
DEFAULT_BANK_OBJECTIVES = 1.0
# A colocated worker's most: its steps may run to 1.4 objectives while each stream's mean
# stays within one. Its prompts have no other worker to prefill them, and with every step held
# to the objective their chunks stayed small beside the decodes. Two colocated workers of a
# Xeon with AMX under vLLM's client (bench/serving.py, 35 ms objective, single runs each): TTFT
# p50 427-512 ms, ITL p99 45-52 ms at 1; 311-335 and 50 ms at 1.3; 260-339 and 53-56 ms at
# 1.4, with 5-16% more tokens/s. A decode worker of a P/D pair keeps 1: its local prompts are
# the router's choice, and there 1.4 raised ITL p99 from 45-46 to 53-59 ms for no gain in TTFT.
COLOCATED_BANK_OBJECTIVES = 1.4
# How far a colocated worker's steps may pass the objective follows from what its decodes
# cost: only as far as leaves a prompt chunk this share of the step (`colocated_bank`). A
# step beside decodes of t_dec gives prompts (bank·T − t_dec) of it, so the bank buys prompt
# throughput only where t_dec is a large part of T. On the Xeon above a colocated worker's
# decode steps took ~20 ms: 43% of a 35 ms step left to prompts, 59% at 1.4. On a Zen 4 core
# they took 10-13 ms, 66-71% left at 1: two colocated workers under vLLM's client (two rounds
# each) made TTFT p50 390 and 495 ms with ITL p99 54.9 and 75.0 ms at 1.4
# (bench/results/serving.zen4.run48.json), 453 and 475 ms with 40.5 and 43.3 ms at 1.
COLOCATED_PROMPT_SHARE = 0.6
# Each stream starts with this many longest steps' time past the objective already saved
# ((bank - 1)·T each; none where the bank is 1). Without it the stream that has just left its
# prompt, having saved nothing, held the next prompt's chunks to the objective itself for its
# first tokens, though over its whole output it makes them well within it.
STARTING_CREDIT_STEPS = 3
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


def default_bank_objectives(role: str) -> float:
    """The bank a worker of `role` runs with unless told otherwise (a colocated worker's
    most: `colocated_bank` sets it step by step)."""
    return COLOCATED_BANK_OBJECTIVES if role == "both" else DEFAULT_BANK_OBJECTIVES


def colocated_bank(decode_step_s: float | None, tpot_objective_s: float,
                   most: float = COLOCATED_BANK_OBJECTIVES) -> float:
    """A colocated worker's bank beside decodes whose own step takes `decode_step_s`: the
    least, from 1 up to `most`, whose longest step leaves prompt chunks COLOCATED_PROMPT_SHARE
    of it; `most` until the decodes' cost is measured."""
    if decode_step_s is None or not tpot_objective_s:
        return most
    return min(max(decode_step_s / ((1 - COLOCATED_PROMPT_SHARE) * tpot_objective_s), 1.0), most)


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


def decodes_past_objective(costs: StepCosts, decodes: int, tpot_objective_s: float | None) -> bool:
    """Whether `decodes` decodes alone take longer a step than the TPOT objective (none set or
    their cost unmeasured: no). There no per-step prompt budget keeps them within it: a prompt
    chunk beside them lengthens gaps already past it (`prefill_token_budget`'s floor)."""
    t_dec = costs.decode_step_s(decodes) if tpot_objective_s and decodes > 0 else None
    return t_dec is not None and t_dec > tpot_objective_s


def starting_credit_s(tpot_objective_s: float, bank: float) -> float:
    """The saved time every stream starts with (STARTING_CREDIT_STEPS longest steps' excess
    over the objective; none where the bank is 1)."""
    return STARTING_CREDIT_STEPS * (bank - 1) * tpot_objective_s


def step_allowance_s(tpot_objective_s: float, paces: Iterable[tuple[int, float]],
                     bank: float = DEFAULT_BANK_OBJECTIVES) -> float:
    """The longest next step that keeps every running decode within the objective T over its
    tokens so far. `paces`: (tokens made since its first, seconds since its first) of each;
    one that made m tokens in e seconds may wait T·(m + 1) − e for its next, plus the credit
    every stream starts with (`starting_credit_s`). Never below T: a decode already behind
    holds the step to T as step-by-step pacing would. Never above bank·T (`bank`
    objectives): one step's stall stays bounded."""
    credit = starting_credit_s(tpot_objective_s, bank)
    allowance = bank * tpot_objective_s
    for tokens, seconds in paces:
        allowance = min(allowance, tpot_objective_s * (tokens + 1) - seconds + credit)
    return max(allowance, tpot_objective_s)


def prompt_batch_tokens(costs: StepCosts, ceiling: int) -> int:
    """Tokens of prompts a step with no decodes may start and finish: only as many as cost no
    more than the step's fixed cost F. Every prompt of a step gets its first token at the
    step's end, so two prompts of work S each finish at F + 2S together, or at F + S and
    2(F + S) one after the other: together is sooner on average only while S < F. Batching
    to at least a chunk (512 tokens), a prefill worker under vLLM's serving client ran two or
    three 256-token prompts a step (640 tokens, ~1 s, on a Zen 4 core) and handed them all
    off at its end, where one alone takes ~350 ms. `ceiling` until the costs are measured."""
    cost = costs.prompt_cost()
    if cost is None:
        return ceiling
    return int(min(max(math.ceil(cost.fixed / cost.marginal()), 1), ceiling))


def _finishes(rest: int, fits_now: float, tiles: RowTiles | None, fits_longest: float) -> bool:
    """Whether a prompt's `rest` tokens run in this step though only `fits_now` fit its
    allowance: where they pass it by at most a row tile (FINISHING_SLACK_TOKENS without
    tiles) and the line alone, without the margin, puts them within the longest allowed
    step (`fits_longest` tokens). Its last few tokens otherwise took a step of their own,
    nearly all fixed cost: 12 tokens in 38 ms beside three decodes where those decodes alone
    take ~20 ms (two colocated workers of a Xeon with AMX, bench/serving.py). Ending it now
    gives the prompt its first token a step sooner and spares its neighbours that step."""
    tile = tiles.size if tiles is not None and tiles.size > 1 else FINISHING_SLACK_TOKENS
    return fits_now < rest <= max(fits_now, 0.0) + tile and rest <= fits_longest


class RowTiles(NamedTuple):
    """A step of at least `from_rows` rows runs its products `size` rows at a time (the panel
    products on quantized weights: native/quant_bf16.h's and quant_int8.h's passes), and a
    partly filled tile costs about what a full one does."""

    size: int
    from_rows: int = 0


def on_row_tiles(tokens: int, decodes: int, tiles: RowTiles | None, ceiling: int, fits: bool) -> int:
    """`tokens` prompt tokens beside `decodes` moved to a row tile's end: down where they
    were sized to fit the step's allowance (the cost line, fitted on steps of whole tiles,
    prices a partial tile below what it costs), up where they were raised past it anyway
    (the rest of the last tile is nearly free). On a Zen 4 core (AVX512-BF16, passes of 8
    rows), four decodes beside 16 prompt tokens (20 rows) took 38.4 ms, beside 12 (16 rows)
    30.7 ms, beside 20 (24 rows) 39.3 ms (bench/mixed_steps.py)."""
    rows = decodes + tokens
    if tiles is None or tiles.size <= 1 or tokens <= 0 or tokens >= ceiling or rows < tiles.from_rows:
        return tokens
    if fits:
        down = rows // tiles.size * tiles.size - decodes
        return down if down > 0 else tokens
    return min(-(-rows // tiles.size) * tiles.size - decodes, ceiling)


def prefill_token_budget(tpot_objective_s: float | None, decodes: int, costs: StepCosts,
                         ceiling: int, floor: int = MIN_PROMPT_TOKENS_PER_STEP,
                         allowance_s: float | None = None, wanted: int | None = None,
                         deferred_s: float = 0.0, bank: float = DEFAULT_BANK_OBJECTIVES,
                         context_start: int = 0, tiles: RowTiles | None = None,
                         finishing: int | None = None) -> int:
    """Prompt tokens the next step may carry next to `decodes` running decodes, in a step of
    at most `allowance_s` (default: the objective itself; see `step_allowance_s`). `wanted`:
    the prompt tokens waiting; `deferred_s`: how long they have waited for a worthwhile
    chunk. 0 means wait: decode-only steps first, then a chunk worth its fixed cost; never
    longer than the longest allowed step (fresh decodes, which have saved nothing yet, could
    otherwise hold prompts back step after step). `context_start`: where the next chunk
    starts in its prompt (its attention work grows with it). `tiles`: how the step's
    products take its rows (`on_row_tiles`). `finishing`: the tokens the prompt under way
    has left; where they pass what fits by at most a row tile, it may end in this step
    (`_finishes`)."""
    if not tpot_objective_s or decodes == 0:
        return ceiling
    t_dec = costs.decode_step_s(decodes)
    cost = costs.prompt_cost()
    if t_dec is None or cost is None:
        return ceiling
    # the step priced on top of its decodes' own cost (t_dec), or whole once the steps beside
    # decodes are measured; `fixed`: what prompt tokens add to a step beyond a decode-only one
    base, fixed = t_dec, cost.fixed
    whole = costs.chunk_step_cost(decodes, cost)
    if whole is not None:
        base, cost, fixed = 0.0, whole, max(whole.fixed - t_dec, 0.0)
    per_token = cost.marginal(context_start)

    def fit(seconds: float) -> float:
        return cost.tokens_within(seconds - base, context_start)

    def fit_line(seconds: float) -> float:
        """`fit` by the line alone, without the margin kept for the slowest steps."""
        return cost._replace(margin=0.0).tokens_within(seconds - base, context_start)

    most = fit(bank * tpot_objective_s)  # what the longest allowed step holds
    if most < floor:
        # decodes alone (nearly) past the objective: it is lost either way, and starving
        # prompts would only trade it for unbounded time to first token; prompts may add
        # half a decode step
        forced = int(min(max(UNREACHABLE_SHARE * t_dec / per_token, floor), ceiling))
        return on_row_tiles(forced, decodes, tiles, ceiling, fits=False)
    allowed = min(max(allowance_s or 0.0, tpot_objective_s), bank * tpot_objective_s)
    now = fit(allowed)
    if finishing and _finishes(finishing, now, tiles, fit_line(bank * tpot_objective_s)):
        return min(finishing, ceiling)
    # a chunk whose fixed part is at most a third of its cost; less is worth waiting for
    worthwhile = min(2 * fixed / per_token, most, wanted if wanted is not None else ceiling, ceiling)
    if now < worthwhile and deferred_s < bank * tpot_objective_s:
        return 0
    tokens = int(min(max(now, floor), ceiling))
    if now >= floor:
        # the chunk may fill its last row tile where the line alone, without the margin kept
        # for the slowest steps, still ends the step within the allowance: rounded down to
        # the tile below, chunks beside one decode late in a prompt ran 15 tokens (16 rows)
        # in 21-25 ms steps under a 35 ms objective (two colocated workers, a Xeon with AMX,
        # bench/serving.py)
        filled = on_row_tiles(tokens, decodes, tiles, ceiling, fits=False)
        if filled > tokens and fit_line(allowed) >= filled:
            return filled
    return on_row_tiles(tokens, decodes, tiles, ceiling, fits=now >= floor)
