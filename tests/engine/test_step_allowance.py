"""The time a step may take beside running decodes: each decode's pace against the TPOT
objective (`step_allowance_s`), the bank of saved time a longer step may spend, and a
colocated worker's bank set by what its decodes cost (`colocated_bank`)."""

from __future__ import annotations

import time

import pytest

from baton.engine.config import EngineConfig
from baton.engine.step_budget import (
    COLOCATED_BANK_OBJECTIVES,
    COLOCATED_PROMPT_SHARE,
    DEFAULT_BANK_OBJECTIVES,
    STARTING_CREDIT_STEPS,
    RowTiles,
    colocated_bank,
    default_bank_objectives,
    prefill_token_budget,
    starting_credit_s,
    step_allowance_s,
)
from tests.engine.test_step_budget import costs_of
from tests.engine.test_step_budget_chunks import BANK


def test_allowance_is_the_time_each_decode_has_saved_against_the_objective():
    credit = starting_credit_s(0.1, BANK)  # every stream starts with it
    # 5 tokens in 1.3 s under a 0.1 s objective: the next may come 0.6 - 1.3 + credit later
    assert step_allowance_s(0.1, [(5, 1.3)], BANK) == pytest.approx(0.6 - 1.3 + credit)
    # the decode with the least saved time decides for the whole step: 0.3 - 1.05 + credit
    assert step_allowance_s(0.1, [(5, 1.3), (2, 1.05)], BANK) == pytest.approx(0.3 - 1.05 + credit)


def test_allowance_is_never_below_the_objective_nor_above_its_bank_limit():
    assert step_allowance_s(0.1, [], BANK) == pytest.approx(0.1 * BANK)
    assert step_allowance_s(0.1, [(10, 3.0)], BANK) == pytest.approx(0.1)  # already behind
    assert step_allowance_s(0.1, [(1000, 1.0)], BANK) == pytest.approx(0.1 * BANK)
    # unbanked, no credit either: a fresh decode holds the step to the objective
    assert step_allowance_s(0.1, [(0, 0.0)], 1.0) == pytest.approx(0.1)
    assert step_allowance_s(0.1, [(1000, 1.0)], 1.0) == pytest.approx(0.1)


def test_a_colocated_worker_banks_by_default_and_the_others_do_not():
    assert default_bank_objectives("decode") == default_bank_objectives("prefill") == DEFAULT_BANK_OBJECTIVES
    assert default_bank_objectives("both") == COLOCATED_BANK_OBJECTIVES
    assert 1 < COLOCATED_BANK_OBJECTIVES < 2  # a step past the objective, bounded
    assert EngineConfig(role="decode").bank_objectives == DEFAULT_BANK_OBJECTIVES
    assert EngineConfig(role="both").bank_objectives == COLOCATED_BANK_OBJECTIVES
    assert EngineConfig(role="both", tpot_bank_objectives=1.0).bank_objectives == 1.0  # told: kept
    assert EngineConfig(role="both").bank_follows_decodes  # up to its most, step by step
    assert not EngineConfig(role="both", tpot_bank_objectives=1.0).bank_follows_decodes
    assert not EngineConfig(role="decode").bank_follows_decodes
    converted = EngineConfig(role="decode")
    converted.role = "both"  # the default follows the role it runs as now
    assert converted.bank_objectives == COLOCATED_BANK_OBJECTIVES
    assert converted.bank_follows_decodes
    with pytest.raises(ValueError, match="tpot_bank_objectives"):
        EngineConfig(tpot_bank_objectives=0.5).validate()


def test_a_colocated_worker_banks_only_as_far_as_its_decodes_leave_prompts_too_little():
    objective = 0.035
    # decodes of 11 ms (a Zen 4 core, four streams) leave prompts 69% of a 35 ms step: no bank
    assert colocated_bank(0.011, objective) == 1.0
    # decodes of 20 ms (a Xeon with AMX) leave 43%: the most, where 1.4 left 59%
    assert colocated_bank(0.020, objective) == COLOCATED_BANK_OBJECTIVES
    # between, the least bank whose longest step leaves the share
    bank = colocated_bank(0.017, objective)
    assert 1 < bank < COLOCATED_BANK_OBJECTIVES
    assert 1 - 0.017 / (bank * objective) == pytest.approx(COLOCATED_PROMPT_SHARE)
    assert colocated_bank(0.017, objective, most=1.1) == 1.1  # never past the most
    assert colocated_bank(None, objective) == COLOCATED_BANK_OBJECTIVES  # not measured yet: the most
    assert colocated_bank(0.050, 0.0) == COLOCATED_BANK_OBJECTIVES  # no objective


def _add_paced_stream(engine, monkeypatch, bank: float | None) -> None:
    """A stream ("paced", 8 tokens) under a 100 ms objective, `bank` as asked (None: the
    role's own); the caller steps it and aborts it."""
    from baton.engine.sampling import SamplingParams

    monkeypatch.setattr(engine.config, "tpot_objective_s", 0.1)
    monkeypatch.setattr(engine.config, "tpot_bank_objectives", bank)
    engine.add_request("Pacing:", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       request_id="paced")


def test_a_colocated_engine_spends_saved_time_only_where_its_decodes_crowd_prompts_out(engine_fp32, monkeypatch):
    """A colocated engine (role both, no bank asked for) whose stream has saved time: where its
    decodes take a quarter of the objective the step stays within it, the prompt chunk what
    fits there; where they take 60% the saved time buys a larger chunk, up to the most."""
    from baton.engine.sampling import SamplingParams

    engine = engine_fp32
    assert engine.config.role == "both"
    _add_paced_stream(engine, monkeypatch, bank=None)
    try:
        for _ in range(3):
            engine.step()
        engine.add_request("A waiting prompt " * 40, SamplingParams(max_tokens=1), request_id="waiting")
        seq = engine.sequences["paced"]
        made = seq.num_completion_tokens - 1
        seq.paced_from = (time.monotonic() - 0.01 * made, 1)  # far ahead of its pace

        monkeypatch.setattr(engine, "step_costs", costs_of(0.02, 0.005, 0.001))  # 1 decode: 25 ms
        assert engine._prefill_cap() == pytest.approx(75, abs=2)  # (100 - 25) ms: no bank

        monkeypatch.setattr(engine, "step_costs", costs_of(0.055, 0.005, 0.001))  # 1 decode: 60 ms
        most = COLOCATED_BANK_OBJECTIVES
        assert colocated_bank(0.06, 0.1) == most
        assert engine._prefill_cap() == pytest.approx(1000 * (most * 0.1 - 0.06), abs=2)  # 80 past 40
    finally:
        for rid in ("paced", "waiting"):
            engine.abort(rid)
            engine.release(rid)


def test_a_colocated_step_may_spend_saved_time_up_to_its_bank():
    bank = COLOCATED_BANK_OBJECTIVES
    # saved 0.3 s against a 100 ms objective: one step may run to 140 ms, no further
    assert step_allowance_s(0.1, [(5, 0.2)], bank) == pytest.approx(0.1 * bank)
    # a fresh stream's credit buys STARTING_CREDIT_STEPS longest steps in a row, then its pace
    # holds the step to the objective until decode-only steps have saved time again
    longest = 0.1 * bank
    for steps in range(STARTING_CREDIT_STEPS):
        assert step_allowance_s(0.1, [(steps, steps * longest)], bank) == pytest.approx(longest)
    behind = STARTING_CREDIT_STEPS
    assert step_allowance_s(0.1, [(behind, behind * longest)], bank) == pytest.approx(0.1)
    costs = costs_of(0.02, 0.005, 0.001)  # 8 decodes take 60 ms, 1 ms per prompt token
    assert prefill_token_budget(0.1, 8, costs, ceiling=2048, allowance_s=0.4,
                                bank=COLOCATED_BANK_OBJECTIVES) == pytest.approx(80, abs=2)


def test_a_prompts_last_few_tokens_run_with_its_chunk_where_the_longest_step_holds_them():
    costs = costs_of(0.02, 0.005, 0.001)  # 8 decodes take 60 ms, 1 ms per prompt token
    budget = dict(ceiling=2048, allowance_s=0.1, bank=COLOCATED_BANK_OBJECTIVES)
    assert prefill_token_budget(0.1, 8, costs, **budget) == pytest.approx(40, abs=1)  # what fits
    # 50 left: within a row tile (16 without tiles) of it, and 110 ms by the line: all of it
    assert prefill_token_budget(0.1, 8, costs, **budget, finishing=50) == 50
    # 60 left: more than a tile past what fits, so the prompt takes another step anyway
    assert prefill_token_budget(0.1, 8, costs, **budget, finishing=60) == pytest.approx(40, abs=1)
    # unbanked, the longest step is the objective itself: nothing past it
    assert prefill_token_budget(0.1, 8, costs, ceiling=2048, allowance_s=0.1, finishing=50) == pytest.approx(
        40, abs=1)
    # with row tiles of 32 the last tile's worth may come along
    tiles = RowTiles(32)
    assert prefill_token_budget(0.1, 8, costs, **budget, tiles=tiles, finishing=70) == 70
    assert prefill_token_budget(0.1, 8, costs, **budget, tiles=tiles, finishing=90) < 90


def test_by_default_no_step_runs_past_the_objective():
    """A decode or prefill worker's default bank."""
    assert DEFAULT_BANK_OBJECTIVES == 1.0
    assert step_allowance_s(0.1, [(5, 0.2)]) == pytest.approx(0.1)  # saved 0.3 s: not spent
    costs = costs_of(0.02, 0.005, 0.001)  # 8 decodes take 60 ms, 1 ms per prompt token
    # what fits in one objective, however long the prompt has waited
    assert prefill_token_budget(0.1, 8, costs, ceiling=2048, allowance_s=0.4, wanted=500,
                                deferred_s=10.0) == pytest.approx(40, abs=2)


def test_saved_time_buys_a_larger_chunk():
    costs = costs_of(0.02, 0.005, 0.001)  # 8 decodes take 60 ms, 1 ms per prompt token
    per_step = prefill_token_budget(0.1, 8, costs, ceiling=2048)
    banked = prefill_token_budget(0.1, 8, costs, ceiling=2048, allowance_s=0.3, bank=BANK)
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
    _add_paced_stream(engine, monkeypatch, bank=BANK)
    try:
        for _ in range(3):
            engine.step()
        monkeypatch.setattr(engine, "step_costs", costs_of(0.02, 0.005, 0.001))  # 1 decode: 25 ms
        assert engine._prefill_cap() is None  # no prompt waiting: nothing to cap
        engine.add_request("A waiting prompt " * 40, SamplingParams(max_tokens=1), request_id="waiting")
        seq = engine.sequences["paced"]
        started, tokens = seq.paced_from
        assert tokens == 1 and started == pytest.approx(seq.first_token_time)
        made = seq.num_completion_tokens - 1
        credit = starting_credit_s(0.1, BANK)
        # at the objective, its starting credit spent: nothing saved
        seq.paced_from = (time.monotonic() - 0.1 * made - credit, 1)
        assert engine._prefill_cap() == pytest.approx(75, abs=2)  # (100 - 25) ms at 1 ms a token
        seq.paced_from = (time.monotonic() - 0.01 * made - credit, 1)  # fast: about 0.1·(made+1) s saved
        expected = prefill_token_budget(0.1, 1, engine.step_costs, engine.config.max_num_batched_tokens,
                                        allowance_s=0.1 * (made + 1) - 0.01 * made, bank=BANK)
        assert engine._prefill_cap() == pytest.approx(expected, abs=2)
        assert expected > 75
    finally:
        for rid in ("paced", "waiting"):
            engine.abort(rid)
            engine.release(rid)
