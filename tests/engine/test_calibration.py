"""A worker's step costs measured before its first request (engine/calibration.py): the
budget's fits exist at once, and the engine is otherwise left as a fresh one."""

from __future__ import annotations

import pytest

from baton.engine import SamplingParams
from baton.engine.calibration import LATE_CHUNK, PROMPT_ROUNDS, PROMPT_SIZES, calibrate
from baton.engine.step_budget import StepCosts, attention_work, prefill_token_budget

from .conftest import make_engine

PARAMS = SamplingParams(max_tokens=8)


def test_a_calibrated_engine_has_its_costs_and_nothing_else(engine_fp32):
    e = make_engine()
    free = e.blocks.num_free_blocks
    assert e.step_costs.prompt_cost() is None and e.step_costs.decode_step_s(1) is None
    said = calibrate(e)
    assert said.startswith("calibrated in") and "decode steps of 1 and 8 streams" in said, said
    cost = e.step_costs.prompt_cost()
    assert cost is not None and cost.per_token > 0 and cost.fixed >= 0
    assert 0 < e.step_costs.decode_step_s(1) <= e.step_costs.decode_step_s(4)
    assert e.step_costs.prefill_s_per_token is None  # a real prompt's to set
    # each size ran whole beside the eight streams, whatever the budget would have cut it to,
    # and one step of each size is kept: the median of its rounds; so is the late chunk, which
    # found the longest prompt cached and attended over it; the streams' own prompts are not
    kept = {(p, w, seconds) for p, w, _, decodes, seconds in e.step_costs._prompt_steps}
    longest = max(PROMPT_SIZES)
    assert {decodes for _, _, _, decodes, _ in e.step_costs._prompt_steps} == {8}
    assert sorted((p, w) for p, w, _ in kept) == sorted([(n, attention_work(0, n)) for n in PROMPT_SIZES]
                                                        + [(LATE_CHUNK, attention_work(longest, LATE_CHUNK))])
    assert len(e.step_costs._prompt_steps) == PROMPT_ROUNDS * len(kept)  # each median as often as its size ran
    # the budget now caps a prompt beside running decodes at once
    capped = prefill_token_budget(0.001 + e.step_costs.decode_step_s(4), 4, e.step_costs, 2048)
    assert capped < 2048
    # nothing else is left: no sequence, every block free (no cached prefix), zero counters
    assert not e.sequences and e.blocks.num_free_blocks == free
    assert e.stats.prompt_tokens == 0 and e.stats.steps == 0
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    got = [o.token_ids for o in e.generate(prompts, PARAMS)]
    assert got == [o.token_ids for o in engine_fp32.generate(prompts, PARAMS)]
    assert e.blocks.prefix_queries == sum(len(e.tokenize(p)) for p in prompts)  # counted from zero


def test_of_steps_alike_the_median_is_kept_and_a_slow_one_moves_nothing():
    """Calibration's repeated steps: three of each size, one of them slow (a neighbour took
    the core); the line through the medians is the line through the steady steps."""
    steady, noisy = StepCosts(), StepCosts()
    for costs in (steady, noisy):
        for b in (1, 4, 8):
            costs.observe(b, 0, 0.01 + 0.001 * b)
    for r in range(PROMPT_ROUNDS):
        for tokens in (16, 64, 128):
            seconds = 0.018 + 0.005 + 0.0003 * tokens
            steady.observe(8, tokens, seconds)
            noisy.observe(8, tokens, seconds * (3 if (r, tokens) in ((0, 16), (1, 128)) else 1))
    assert noisy.prompt_cost().per_token != pytest.approx(steady.prompt_cost().per_token, rel=0.05)
    steady.keep_median_prompt_steps()
    noisy.keep_median_prompt_steps()
    assert noisy.prompt_cost() == pytest.approx(steady.prompt_cost())
    assert noisy.prompt_cost().per_token == pytest.approx(0.0003)
    steps = [(p, round(seconds, 6)) for p, _, _, _, seconds in noisy._prompt_steps]
    assert sorted(steps) == sorted([(16, 0.0278), (64, 0.0422), (128, 0.0614)] * PROMPT_ROUNDS)


def test_an_engine_too_small_for_the_prompts_is_left_unmeasured():
    e = make_engine(num_kv_blocks=8)  # 128 tokens: half is too little room
    said = calibrate(e)
    assert said.startswith("not calibrated") and "too few" in said
    assert e.step_costs.prompt_cost() is None and not e.sequences


def test_a_pool_just_big_enough_for_the_prompts_calibrates_and_comes_back_empty():
    """14 blocks of 16: room for the prompts, not for eight streams beside them as well;
    the scheduler preempts some streams and the calibration still ends with every block free."""
    e = make_engine(num_kv_blocks=14, block_size=16)
    said = calibrate(e)
    assert said.startswith("calibrated in"), said
    assert not e.sequences and e.blocks.num_free_blocks == 14


def test_a_busy_engine_is_refused(engine_fp32):
    e = engine_fp32
    e.add_request("The quick brown fox", PARAMS, "busy")
    try:
        with pytest.raises(RuntimeError, match="idle engine"):
            calibrate(e)
    finally:
        e.abort("busy")
        e.release("busy")


def test_a_prefill_worker_keeps_its_prompt_costs_whole():
    """It never decodes: no decode line is left to take a step's own overhead off its
    prompts' cost (the router's per-token rate would read near zero for short prompts)."""
    e = make_engine(role="prefill")
    assert calibrate(e).startswith("calibrated in")
    assert e.step_costs.prompt_cost() is not None and e.step_costs.decode_step_s(1) is None
    e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1))
    assert e.step_costs.prefill_s_per_token > 0
