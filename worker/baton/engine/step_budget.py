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
from collections.abc import Iterable
from typing import NamedTuple

from baton.engine.step_costs import (  # noqa: F401 (also imported from here)
    CHUNK_LINE_STEPS,
    CONTEXT_FIT_STEPS,
    RATE_STEPS,
    PromptCost,
    StepCosts,
    attention_work,
)

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
