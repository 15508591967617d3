"""A worker's step costs, measured on made-up prompts before its first request.

The per-step prompt budget (step_budget.py) caps a step's prompt tokens only once the
engine has seen its own decode-only steps and its own steps with prompt tokens beside
decodes. A decode worker whose prompts all come prefilled sees the second kind only when
the router first keeps prompts at home, which is under a burst, with its streams running:
those first chunks ran uncapped, whole 256-token prompts beside eight decodes, 60-77 ms
gaps against a 40 ms objective (bench/serving.py, P/D, a Xeon with AMX). So a worker
measures both before it serves: a warm-up step (the first ones fault in weights and
buffers), decode-only steps of one stream, four and eight (a few of each: the line takes
each size's median), then prompts of a few sizes beside them. The prompts run whole, not
chunked by the budget being measured, three of each size, and of each size the median step
is kept (as often as its size ran); so is a chunk of the same size as one of them late in
a prompt (LATE_CHUNK), which tells the attention's share of a step from the tokens'. The
streams' own prompts, one step each, are not kept. One prompt of each, chunked by the
budget that the first one's step had set, gave chunks of whatever size that first guess
allowed, and one slow step among so few points
tilted the line: over 128 worker starts of bench/serving.py (a Xeon with AMX) a prompt
token came out at 0.005-0.82 ms, and at 0.005 ms the budget beside four decodes is some
2,000 tokens. On one core shared with a spinning process (bench/calibration_spread.py, 12
calibrations each way, in turn) the budget beside four decodes came out at 16-78 tokens
the old way and 21-25 this way; on the core alone, 60-65 and 47-49 (this way's slope,
0.27-0.28 ms a token, is what steps of 16 and 64 prompt tokens beside eight decodes differ
by in bench/mixed_steps.py). The engine is then left as it was but for its step costs: no
sequences, an empty prefix cache, and its counters as they were (the made-up steps are not
counted). A pool too small for eight streams beside the prompts preempts and recomputes some
of them, and still comes back empty.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager

from baton.engine.sampling import SamplingParams
from baton.engine.step_budget import StepCosts

PROMPT_SIZES = (16, 64, 128)  # prompt tokens of the steps measured beside the decodes
# A chunk late in a prompt: these tokens after the longest prompt's, which they find cached
# (where the prefix cache is on), so the step computes them alone at a start of
# max(PROMPT_SIZES). Fresh prompts alone grow their attention work with their tokens,
# W = P(P+1)/2, and the fit of F + s·P + a·W could only take `a` from the curve of step
# time in P, which carries more than attention: on a Xeon core it came out at 0.03-3.98 µs
# a unit (median 1.04; 2-4 in two colocated workers' serving), where a chunk's rows cost
# 0.165 µs a unit (bench/mixed_steps.py, 8 and 64 rows at starts 0 and 1,800), and 0.00-0.46
# (median 0.17) with this step (bench/calibration_spread.py; docs/benchmarks.md).
LATE_CHUNK = 64
DECODE_BATCHES = (1, 4, 8)  # decodes running, in turn
PROMPT_ROUNDS = 3  # steps of each size: their median is the one kept
DECODE_STEPS = 3  # decode-only steps measured at each (a median: one slow step is outvoted)
STEP_LIMIT = 64  # steps one calibration prompt may take (where the scheduler chunks it)


def calibrate(engine) -> str:
    """Measure `engine`'s step costs (drained: no sequences) and return what was found, in
    words; an engine too small for the prompts is left unmeasured, and says so."""
    if engine.sequences:
        raise RuntimeError(f"calibrate an idle engine: {len(engine.sequences)} sequences are in it")
    room = min(engine.max_model_len, engine.blocks.num_blocks * engine.config.block_size // 2)

    def fits(n: int) -> bool:
        return n + 8 + DECODE_STEPS + STEP_LIMIT <= room

    sizes = [n for n in PROMPT_SIZES if fits(n)]
    if not sizes:
        return f"not calibrated: {room} tokens of room is too few for its prompts"
    late = fits(sizes[-1] + LATE_CHUNK) and engine.config.enable_prefix_caching
    vocab = engine.model_config.vocab_size
    started = time.perf_counter()
    counters, engine.stats = engine.stats, type(engine.stats)()
    try:
        # each prompt's first token differs, so no prompt finds another's blocks cached
        def prompt(n: int, k: int) -> list[int]:
            return [(k + 1 + 31 * i) % vocab for i in range(n)]

        _run_to_end(engine, "calibration-warmup", prompt(16, 0), max_tokens=2)
        engine.step_costs = StepCosts()
        streams = SamplingParams(max_tokens=STEP_LIMIT * 4, ignore_eos=True)
        for batch in DECODE_BATCHES:  # decode-only steps of a few batch sizes: t_dec(B)'s slope too
            while len(engine.sequences) - 1 < batch:  # the warm-up's finished sequence is still in
                engine.add_request(prompt(8, len(engine.sequences) + 1), streams,
                                   f"calibration-decode-{len(engine.sequences)}")
            for _ in range(1 + DECODE_STEPS):  # the new streams' prompts, then decodes alone
                engine.step()
        # the streams' own prompts ran once each, unrepeated, and the first steps with prompt
        # tokens beside decodes can be several times slower (8 tokens beside one decode in
        # 52 ms, not 15-19, on a busy Xeon core): the prompt line is the measured sizes' alone
        engine.step_costs.forget_prompt_steps()
        with _budget_lifted(engine):
            longest: list[int] = []  # the round's longest prompt, which the late chunk follows
            for r in range(PROMPT_ROUNDS):  # sizes back and forth: a slow spell hits them alike
                for k, n in enumerate(sizes if r % 2 == 0 else sizes[::-1]):
                    ids = prompt(n, 100 + len(sizes) * r + k)
                    longest = ids if n == sizes[-1] else longest
                    _run_to_end(engine, f"calibration-{n}-{r}", ids, max_tokens=1)
                if late:
                    _run_to_end(engine, f"calibration-late-{r}", longest + prompt(LATE_CHUNK, 200 + r),
                                max_tokens=1)
        engine.step_costs.keep_median_prompt_steps()
    finally:
        engine._forget_requests()
        engine.stats = counters
    # the router's per-token prefill cost is a real prompt's to set: made-up prompts of a
    # few tokens are mostly fixed cost
    engine.step_costs.forget_prefill_rate()
    if engine.config.role == "prefill":
        # it never decodes: its prompts' cost is their whole steps, as before it was measured
        engine.step_costs.forget_decode_steps()
    costs = engine.step_costs
    cost, one, most = costs.prompt_cost(), costs.decode_step_s(1), costs.decode_step_s(DECODE_BATCHES[-1])
    took = time.perf_counter() - started
    if cost is None:
        return f"not calibrated: no prompt cost measured in {took:.2f} s"
    decodes = (f"decode steps of 1 and {DECODE_BATCHES[-1]} streams {one * 1e3:.1f} and {most * 1e3:.1f} ms; "
               if one is not None else "")
    return (f"calibrated in {took:.2f} s: {decodes}prompt tokens add {cost.fixed * 1e3:.1f} ms + "
            f"{cost.per_token * 1e3:.3f} ms each")


@contextmanager
def _budget_lifted(engine) -> Iterator[None]:
    """The engine with no per-step prompt budget: each prompt in one step, of the size asked."""
    config = engine.config
    engine.config = dataclasses.replace(config, tpot_objective_s=None)
    try:
        yield
    finally:
        engine.config = config


def _run_to_end(engine, request_id: str, prompt: list[int], max_tokens: int) -> None:
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id)
    for _ in range(STEP_LIMIT):
        if engine.sequences[request_id].is_finished:
            return
        engine.step()
    raise RuntimeError(f"calibration prompt {request_id} did not finish in {STEP_LIMIT} steps")
