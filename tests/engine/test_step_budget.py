"""The TPOT budget for prompt tokens: measured step costs in, prompt tokens per step out."""

from __future__ import annotations

import time

import pytest

from baton.engine.config import EngineConfig
from baton.engine.step_budget import (
    MAX_BANKED_OBJECTIVES,
    MIN_PROMPT_TOKENS_PER_STEP,
    UNREACHABLE_SHARE,
    StepCosts,
    prefill_token_budget,
    step_allowance_s,
)
from tests.engine.test_scheduler import complete, make, seq


def costs_of(intercept_s: float, per_seq_s: float, per_token_s: float) -> StepCosts:
    """Feed steps that follow t = a + b·B + c·P exactly."""
    costs = StepCosts()
    for b in (1, 2, 4, 8, 2, 6):
        costs.observe(b, 0, intercept_s + per_seq_s * b)
    for b, p in ((2, 64), (4, 128), (0, 256)):
        costs.observe(b, p, intercept_s + per_seq_s * b + per_token_s * p)
    return costs


def test_decode_cost_is_the_line_through_decode_only_steps():
    costs = costs_of(0.02, 0.005, 0.001)
    assert costs.decode_step_s(10) == pytest.approx(0.07)
    assert costs.prefill_s_per_token == pytest.approx(0.001, rel=0.05)


def test_budget_is_what_fits_between_the_decodes_and_the_objective():
    costs = costs_of(0.02, 0.005, 0.001)
    # 8 decodes take 60 ms; 40 ms left at 1 ms per prompt token
    assert prefill_token_budget(0.1, 8, costs, ceiling=2048) == pytest.approx(40, abs=2)
    assert prefill_token_budget(0.5, 8, costs, ceiling=2048) == pytest.approx(440, abs=20)
    assert prefill_token_budget(0.5, 8, costs, ceiling=256) == 256


def test_no_cap_without_decodes_objective_or_measurements():
    costs = costs_of(0.02, 0.005, 0.001)
    assert prefill_token_budget(0.1, 0, costs, ceiling=2048) == 2048
    assert prefill_token_budget(None, 8, costs, ceiling=2048) == 2048
    assert prefill_token_budget(0.0, 8, costs, ceiling=2048) == 2048
    assert prefill_token_budget(0.1, 8, StepCosts(), ceiling=2048) == 2048


def test_prompts_add_half_a_decode_step_once_decodes_alone_exceed_the_objective():
    costs = costs_of(0.2, 0.05, 0.001)  # 8 decodes take 600 ms: a 100 ms objective is lost
    assert prefill_token_budget(0.1, 8, costs, ceiling=2048) == pytest.approx(300, rel=0.2)
    slow_prompts = costs_of(0.2, 0.05, 0.1)
    assert prefill_token_budget(0.1, 8, slow_prompts, ceiling=2048) == MIN_PROMPT_TOKENS_PER_STEP


def test_one_batch_size_seen_scales_with_the_batch():
    costs = StepCosts()
    for _ in range(5):
        costs.observe(4, 0, 0.04)
    assert costs.decode_step_s(8) == pytest.approx(0.08)
    costs.observe(4, 0, float("nan"))
    costs.observe(0, 0, 1.0)
    assert costs.decode_step_s(4) == pytest.approx(0.04)


def test_scheduler_cap_limits_prompt_tokens_next_to_decodes_only():
    bm, sched = make(num_blocks=64, budget=64, chunk=64)
    running = seq(4, "running")
    sched.add(running)
    complete(sched.schedule())
    assert sched.num_decoding() == 1
    sched.add(seq(40, "long"))
    batch = sched.schedule(prefill_cap=10)
    assert batch.decodes == [running]
    assert [(s.request_id, n) for s, n in batch.prefills] == [("long", 10)]
    assert batch.num_tokens == 11


def test_bad_objective_is_refused_with_its_name():
    with pytest.raises(ValueError, match="tpot_objective_s"):
        EngineConfig(tpot_objective_s=float("nan")).validate()
    with pytest.raises(ValueError, match="tpot_objective_s"):
        EngineConfig(tpot_objective_s=-1).validate()


def test_the_engine_chunks_a_prompt_next_to_running_decodes_under_the_objective(engine_fp32, monkeypatch):
    """An objective no prompt chunk can meet: once the engine has measured its steps, a
    prompt that arrives while a request decodes advances by the minimum per step, and both
    requests finish with the tokens they produce alone."""
    from baton.engine.sampling import SamplingParams

    engine, greedy = engine_fp32, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    short, long = "Budgets:", "Seven tall ships sailed past the harbour wall at dawn. " * 6
    monkeypatch.setattr(engine.config, "tpot_objective_s", 1e-6)
    seen = []
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda cap=None: seen.append(schedule(cap)) or seen[-1])
    engine.add_request(short, greedy, request_id="budget-short")
    for _ in range(3):
        engine.step()
    engine.add_request(long, greedy, request_id="budget-long")
    results = {}
    while engine.has_unfinished():
        results.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    for rid in ("budget-short", "budget-long"):  # the engine is shared: leave nothing behind
        engine.release(rid)
    beside_decodes = [b.num_tokens - len(b.decodes) for b in seen[3:] if b.decodes and b.prefills]
    assert len(beside_decodes) >= 3, "the long prompt should have run in several chunks"
    costs = engine.step_costs  # the objective is unreachable: half a measured decode step at most
    allowed = max(MIN_PROMPT_TOKENS_PER_STEP, UNREACHABLE_SHARE * costs.decode_step_s(2) / costs.prefill_s_per_token)
    assert max(beside_decodes) <= allowed + 1
    alone = [out.token_ids for out in engine.generate([short, long], greedy)]
    assert [results["budget-short"], results["budget-long"]] == alone


def test_allowance_is_the_time_each_decode_has_saved_against_the_objective():
    # 5 tokens in 0.2 s under a 0.1 s objective: the next may come 0.6 - 0.2 = 0.4 s later
    assert step_allowance_s(0.1, [(5, 0.2)]) == pytest.approx(0.4)
    # the decode with the least saved time decides for the whole step
    assert step_allowance_s(0.1, [(5, 0.2), (2, 0.25)]) == pytest.approx(0.05 + 0.05, abs=1e-9)


def test_allowance_is_never_below_the_objective_nor_above_its_bank_limit():
    assert step_allowance_s(0.1, []) == pytest.approx(0.1 * MAX_BANKED_OBJECTIVES)
    assert step_allowance_s(0.1, [(0, 0.0)]) == pytest.approx(0.1)  # fresh: step by step
    assert step_allowance_s(0.1, [(10, 3.0)]) == pytest.approx(0.1)  # already behind
    assert step_allowance_s(0.1, [(1000, 1.0)]) == pytest.approx(0.1 * MAX_BANKED_OBJECTIVES)


def test_saved_time_buys_a_larger_chunk():
    costs = costs_of(0.02, 0.005, 0.001)  # 8 decodes take 60 ms, 1 ms per prompt token
    per_step = prefill_token_budget(0.1, 8, costs, ceiling=2048)
    banked = prefill_token_budget(0.1, 8, costs, ceiling=2048, allowance_s=0.3)
    assert per_step == pytest.approx(40, abs=2)
    assert banked == pytest.approx(240, abs=5)
    # an allowance under the objective never shrinks the per-step budget
    assert prefill_token_budget(0.1, 8, costs, ceiling=2048, allowance_s=0.01) == per_step


def test_the_engine_gives_a_prompt_the_time_its_decodes_saved(engine_fp32, monkeypatch):
    """The cap next to a running decode follows that decode's own pace: one that has made its
    tokens at the objective gets the per-step budget, one that saved time lets a larger chunk
    through, and the pace starts at the first token this engine produced."""
    from baton.engine.sampling import SamplingParams

    engine = engine_fp32
    monkeypatch.setattr(engine.config, "tpot_objective_s", 0.1)
    engine.add_request("Pacing:", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       request_id="paced")
    try:
        for _ in range(3):
            engine.step()
        monkeypatch.setattr(engine, "step_costs", costs_of(0.02, 0.005, 0.001))  # 1 decode: 25 ms
        seq = engine.sequences["paced"]
        started, tokens = seq.paced_from
        assert tokens == 1 and started == pytest.approx(seq.first_token_time)
        made = seq.num_completion_tokens - 1
        seq.paced_from = (time.monotonic() - 0.1 * made, 1)  # at the objective: nothing saved
        assert engine._prefill_cap() == pytest.approx(75, abs=2)  # (100 - 25) ms at 1 ms a token
        seq.paced_from = (time.monotonic() - 0.01 * made, 1)  # fast: about 0.1·(made+1) s saved
        expected = prefill_token_budget(0.1, 1, engine.step_costs, engine.config.max_num_batched_tokens,
                                        allowance_s=0.1 * (made + 1) - 0.01 * made)
        assert engine._prefill_cap() == pytest.approx(expected, abs=2)
        assert expected > 75
    finally:
        engine.abort("paced")
        engine.release("paced")
