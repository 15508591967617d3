"""The TPOT budget's prompt chunks: a chunk's fixed cost and its context's, chunks held back
for a worthwhile size, prompts batched alone, the margin kept for steps that stray from the
line, and steps beside decodes priced whole."""

from __future__ import annotations

import time

import pytest

from baton.engine.step_budget import (
    CHUNK_LINE_STEPS,
    CONTEXT_FIT_STEPS,
    MIN_PROMPT_TOKENS_PER_STEP,
    PromptCost,
    RowTiles,
    StepCosts,
    attention_work,
    on_row_tiles,
    prefill_token_budget,
    prompt_batch_tokens,
    starting_credit_s,
)

BANK = 4.0  # objectives a step may bank where saving time is asked for


def costs_with_fixed(fixed_s: float, per_token_s: float, decode_s: float = 0.01) -> StepCosts:
    """Decode steps of `decode_s` a sequence; prompt chunks of several sizes costing F + s·P."""
    costs = StepCosts()
    for b in (1, 2, 4, 8):
        costs.observe(b, 0, decode_s * b)
    for b, p in ((2, 16), (3, 64), (1, 128), (2, 256)):
        costs.observe(b, p, decode_s * b + fixed_s + per_token_s * p)
    return costs


def test_prompt_cost_separates_a_fixed_part_from_the_cost_per_token():
    fixed, per_token, per_context, margin = costs_with_fixed(0.06, 0.001).prompt_cost()
    assert fixed == pytest.approx(0.06, rel=0.01) and per_token == pytest.approx(0.001, rel=0.01)
    assert per_context < 1e-9  # these chunks cost the same wherever they start
    assert margin == 0.0  # four steps: too few to say how far they stray
    one_size = StepCosts()
    for _ in range(4):
        one_size.observe(0, 64, 0.128)
    assert one_size.prompt_cost() == (0.0, pytest.approx(0.002), 0.0, 0.0)  # F cannot be told apart
    assert StepCosts().prompt_cost() is None


def test_a_vanishing_context_cost_leaves_the_tokens_that_fit_as_without_it():
    for per_context in (0.0, 1e-21, 1e-15):  # a fit of exact steps leaves rounding here
        cost = PromptCost(0.009, 0.001, per_context)
        assert cost.tokens_within(0.049) == pytest.approx(40, rel=1e-6)
    assert PromptCost(0.009, 0.001, 1e-6).tokens_within(0.049) < 40  # a real one takes its share


def chunked_prompt_costs(fixed_s: float, per_token_s: float, per_context_s: float) -> StepCosts:
    """Decode steps of 10 ms a sequence; chunks of 32-96 tokens along 512-token prompts beside
    4 decodes, each costing F + s·P + a·W (W its rows x their context)."""
    costs = StepCosts()
    for b in (1, 2, 4, 8):
        costs.observe(b, 0, 0.01 * b)
    start = 0
    for tokens in (32, 64, 96, 32, 64, 96, 64, 64):
        work = attention_work(start, tokens)
        costs.observe(4, tokens, 0.04 + fixed_s + per_token_s * tokens + per_context_s * work, work)
        start += tokens
    return costs


def test_a_chunk_late_in_a_long_prompt_is_smaller_so_its_step_keeps_the_objective():
    costs = chunked_prompt_costs(0.01, 0.0004, 2e-6)
    cost = costs.prompt_cost()
    assert cost == (pytest.approx(0.01, rel=0.01), pytest.approx(0.0004, rel=0.01), pytest.approx(2e-6, rel=0.01),
                    pytest.approx(0.0, abs=1e-9))
    sizes = [prefill_token_budget(0.1, 4, costs, ceiling=2048, context_start=start) for start in (0, 256, 1024)]
    assert sizes[0] > sizes[1] > sizes[2] >= MIN_PROMPT_TOKENS_PER_STEP
    for start, size in zip((0, 256, 1024), sizes):  # each fills the objective's room, no more
        assert 0.04 + cost.seconds(size, start) == pytest.approx(0.1, abs=cost.marginal(start + size))
    assert cost.tokens_within(0.05, 0) > cost.tokens_within(0.05, 1024)


def test_chunks_of_one_size_along_a_prompt_still_show_the_context_cost():
    costs = StepCosts()
    for b in (1, 2, 4, 8):
        costs.observe(b, 0, 0.01 * b)
    for start in range(0, 512, 64):  # F and s cannot be told apart: F = 0
        work = attention_work(start, 64)
        costs.observe(4, 64, 0.04 + 0.01 + 0.0004 * 64 + 2e-6 * work, work)
    fixed, per_token, per_context, _ = costs.prompt_cost()
    assert fixed == 0.0 and per_context == pytest.approx(2e-6, rel=0.01)
    assert per_token * 64 == pytest.approx(0.01 + 0.0004 * 64, rel=0.01)


def test_a_chunk_too_small_for_its_fixed_cost_waits_for_saved_time():
    costs = costs_with_fixed(0.06, 0.001)  # 3 decodes take 30 ms; a chunk adds 60 ms + 1 ms a token
    budget = dict(tpot_objective_s=0.1, decodes=3, costs=costs, ceiling=2048, wanted=500, bank=BANK)
    # at the objective only 10 tokens fit: a third of a worthwhile chunk (2F/s = 120): wait
    assert prefill_token_budget(**budget, allowance_s=0.1) == 0
    # once the decodes have saved 150 ms more, one chunk of 160 tokens
    assert prefill_token_budget(**budget, allowance_s=0.25) == pytest.approx(160, abs=2)
    # a prompt that fits whole runs at once; so does one that has waited the longest step:
    # what fits, or the floor
    runs_now = max(10, MIN_PROMPT_TOKENS_PER_STEP)
    assert prefill_token_budget(**{**budget, "wanted": 8}, allowance_s=0.1) == runs_now
    assert prefill_token_budget(**budget, allowance_s=0.1, deferred_s=0.4) == runs_now
    # without a fixed cost nothing is gained by waiting
    linear = costs_with_fixed(0.0, 0.001)
    assert prefill_token_budget(0.1, 3, linear, ceiling=2048, wanted=500, allowance_s=0.1) == pytest.approx(70, abs=2)


class FrozenCosts(StepCosts):
    """Step costs that the engine's own steps do not move."""

    def observe(self, decodes: int, prompt_tokens: int, seconds: float, work: int | None = None) -> None:
        pass


def test_the_engine_holds_a_prompt_back_for_a_worthwhile_chunk_and_not_for_long(engine_fp32, monkeypatch):
    from baton.engine.sampling import SamplingParams

    engine = engine_fp32
    monkeypatch.setattr(engine.config, "tpot_objective_s", 0.1)
    monkeypatch.setattr(engine.config, "tpot_bank_objectives", BANK)
    engine.add_request("Waiting:", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), request_id="dec")
    try:
        for _ in range(2):
            engine.step()
        frozen, measured = FrozenCosts(), costs_with_fixed(0.06, 0.001)
        frozen._decode_steps, frozen._prompt_steps = measured._decode_steps, measured._prompt_steps
        monkeypatch.setattr(engine, "step_costs", frozen)  # 1 decode: 10 ms; a chunk: 60 ms + 1 ms a token
        engine.add_request("A long waiting prompt " * 40, SamplingParams(max_tokens=1), request_id="held")
        seq = engine.sequences["dec"]

        def nothing_saved():  # at the objective, its starting credit spent
            credit = starting_credit_s(0.1, BANK)
            seq.paced_from = (time.monotonic() - 0.1 * (seq.num_completion_tokens - 1) - credit, 1)

        nothing_saved()
        assert engine._prefill_cap() == 0
        before = engine.sequences["held"].num_computed_tokens
        engine.step()  # decodes only: the prompt waits
        assert engine.sequences["held"].num_computed_tokens == before
        assert engine._prompts_deferred_since is not None
        engine._prompts_deferred_since -= 0.4  # as long as the longest allowed step: no more waiting
        nothing_saved()
        assert engine._prefill_cap() == pytest.approx(30, abs=1)  # what fits in the objective now
        engine.step()
        assert engine.sequences["held"].num_computed_tokens > before
        assert engine._prompts_deferred_since is None
    finally:
        for rid in ("dec", "held"):
            engine.abort(rid)
            engine.release(rid)


def test_prompts_alone_batch_only_while_their_work_is_less_than_the_fixed_cost():
    costs = costs_with_fixed(0.06, 0.001)  # a step of prompts: 60 ms + 1 ms a token
    assert prompt_batch_tokens(costs, ceiling=2048) == pytest.approx(60, abs=1)  # F/s
    assert prompt_batch_tokens(costs, ceiling=32) == 32
    # two prompts of 30 tokens: together both at 120 ms; one after the other at 90 and 180
    together, apart = 0.06 + 2 * 0.03, ((0.06 + 0.03) + 2 * (0.06 + 0.03)) / 2
    assert together < apart
    # two of 256: together at 572 ms; apart at 316 and 632, sooner on average
    together, apart = 0.06 + 2 * 0.256, ((0.06 + 0.256) + 2 * (0.06 + 0.256)) / 2
    assert apart < together and prompt_batch_tokens(costs, ceiling=2048) < 2 * 256
    # no fixed cost: batching gains nothing, so one prompt (or one chunk) a step
    assert prompt_batch_tokens(costs_with_fixed(0.0, 0.001), ceiling=2048) == 1
    assert prompt_batch_tokens(StepCosts(), ceiling=2048) == 2048  # not measured yet


def test_prompt_steps_no_slower_than_their_decodes_give_no_cost_and_no_limit():
    """A tiny model's prompt steps beside decodes can all run within the decode line (every
    one's extra seconds zero): that measures no token's cost, so no line is drawn and neither
    budget divides by a zero cost (a prefill worker's step once failed on it)."""
    costs = StepCosts()
    for b in (1, 4, 8):
        costs.observe(b, 0, 0.004 * b)
    for tokens in (16, 64, 128, 64) * 3:
        costs.observe(8, tokens, 0.030)  # under the 32 ms the decode line gives 8 decodes
    assert costs.prompt_cost() is None
    assert prompt_batch_tokens(costs, ceiling=2048) == 2048
    assert prefill_token_budget(0.05, 4, costs, 2048) == 2048


def test_a_prefill_engine_takes_waiting_prompts_a_worthwhile_batch_at_a_time(engine_fp32, monkeypatch):
    """A prefill worker (whole prompts, no decodes): the first runs whole however long; more
    join its step only while the tokens in it stay within F/s. Elsewhere no limit."""
    from baton.engine.sampling import SamplingParams

    engine = engine_fp32
    monkeypatch.setattr(engine.config, "tpot_objective_s", 0.1)
    monkeypatch.setattr(engine.config, "role", "prefill")
    monkeypatch.setattr(engine.scheduler, "shortest_first", True)  # a prefill worker's order
    monkeypatch.setattr(engine.scheduler, "chunk_size", 0)
    monkeypatch.setattr(engine.scheduler, "max_num_batched_tokens", 2048)
    monkeypatch.setattr(engine.config, "max_num_batched_tokens", 2048)
    frozen, measured = FrozenCosts(), costs_with_fixed(0.02, 0.001)  # F/s = 20 tokens
    frozen._decode_steps, frozen._prompt_steps = measured._decode_steps, measured._prompt_steps
    monkeypatch.setattr(engine, "step_costs", frozen)
    prompts = {f"p{i}": list(range(10 + i, 110 + i)) for i in range(4)}  # 100 tokens each

    def run_all() -> list[int]:
        for rid in prompts:
            engine.add_request(prompts[rid], SamplingParams(max_tokens=1), request_id=rid)
        steps = []
        while any(not engine.sequences[rid].is_finished for rid in prompts):
            before = {rid: engine.sequences[rid].num_computed_tokens for rid in prompts}
            engine.step()
            steps.append(sum(engine.sequences[rid].num_computed_tokens - before[rid] for rid in prompts))
        for rid in prompts:
            engine.release(rid)
        return steps

    try:
        assert run_all() == [100, 100, 100, 100]  # a second prompt would pass 20 tokens
        prompts = {f"s{i}": list(range(10 + i, 20 + i)) for i in range(4)}  # 10 tokens each
        assert run_all() == [20, 20]  # two share a step's fixed cost: both sooner than apart
        for rid, ids in prompts.items():
            engine.add_request(ids, SamplingParams(max_tokens=1), request_id=rid)
        assert engine._admission_cap() == 20 and engine._prefill_cap() is None
        monkeypatch.setattr(engine.config, "role", "both")  # prompts that decode here: no limit
        assert engine._admission_cap() is None
        monkeypatch.setattr(engine.config, "role", "prefill")
        monkeypatch.setattr(engine.config, "tpot_objective_s", 0)  # no objective: no batch limit
        assert engine._admission_cap() is None
    finally:
        for rid in prompts:
            engine.release(rid)


def test_budgets_keep_in_hand_how_far_steps_stray_from_the_line():
    """Steps that scatter about the line: the budget leaves room for the scatter's 90th
    percentile, so most steps, not the average one, end within the objective."""
    steady, scattered = StepCosts(), StepCosts()
    for costs in (steady, scattered):
        for b in (1, 2, 4, 8):
            costs.observe(b, 0, 0.01 * b)
    for i, tokens in enumerate((16, 32, 64, 128) * 5):
        for costs, noise in ((steady, 0.0), (scattered, 0.01 * (i % 5 == 0))):  # 1 step in 5: 10 ms more
            costs.observe(2, tokens, 0.02 + 0.005 + 0.0004 * tokens + noise, attention_work(0, tokens))
    assert steady.prompt_cost().margin == pytest.approx(0.0, abs=1e-6)
    assert scattered.prompt_cost().margin > 0.005
    assert (prefill_token_budget(0.05, 2, scattered, ceiling=2048)
            < prefill_token_budget(0.05, 2, steady, ceiling=2048) - 10)


def test_the_margin_is_judged_on_the_steps_a_budget_sizes():
    """Whole prompts run with no decodes beside them (no budget sizes those steps) may stray
    far from the line; the margin then comes from the steps beside decodes, once there are
    enough of them to judge, and from every step before that."""
    def costs(steps_beside_decodes: int) -> StepCosts:
        c = StepCosts()
        for b in (1, 2, 4, 8):
            c.observe(b, 0, 0.01 * b)
        for i in range(steps_beside_decodes):
            tokens = (16, 32, 64, 128)[i % 4]
            c.observe(2, tokens, 0.02 + 0.005 + 0.0004 * tokens, attention_work(0, tokens))
        for i in range(12):  # whole prompts, half of them 20 ms past the line
            tokens = (256, 512, 768)[i % 3]
            c.observe(0, tokens, 0.005 + 0.0004 * tokens + 0.02 * (i % 2 == 0), attention_work(0, tokens))
        return c

    judged_beside_decodes, too_few_to_judge = costs(20), costs(CONTEXT_FIT_STEPS - 1)
    assert judged_beside_decodes.prompt_cost().margin < 0.002
    assert too_few_to_judge.prompt_cost().margin > 0.005
    assert (prefill_token_budget(0.05, 2, judged_beside_decodes, ceiling=2048)
            > prefill_token_budget(0.05, 2, too_few_to_judge, ceiling=2048) + 10)


def test_a_chunk_fills_its_last_row_tile_where_the_line_alone_still_fits():
    """The margin kept for the slowest steps does not also cost a whole row tile: where the
    line without it still ends the step within the objective, the chunk fills its last tile;
    with no margin to spend (steady steps) it stops at the tile below, as before."""
    tiles = RowTiles(16, from_rows=16)
    steady, scattered = StepCosts(), StepCosts()
    for costs in (steady, scattered):
        for b in (1, 2, 4, 8):
            costs.observe(b, 0, 0.01 * b)
    for i, tokens in enumerate((16, 32, 64, 128) * 5):
        for costs, noise in ((steady, 0.0), (scattered, 0.01 * (i % 5 == 0))):
            costs.observe(2, tokens, 0.02 + 0.005 + 0.0004 * tokens + noise, attention_work(0, tokens))
    assert scattered.prompt_cost().margin > 0.005

    untiled = prefill_token_budget(0.05, 2, scattered, ceiling=2048)
    filled = prefill_token_budget(0.05, 2, scattered, ceiling=2048, tiles=tiles)
    assert (2 + filled) % 16 == 0 and untiled < filled < untiled + 16
    line = scattered.prompt_cost()._replace(margin=0.0)
    assert scattered.decode_step_s(2) + line.seconds(filled) <= 0.05

    fitted = prefill_token_budget(0.05, 2, steady, ceiling=2048)
    assert prefill_token_budget(0.05, 2, steady, ceiling=2048, tiles=tiles) == on_row_tiles(fitted, 2, tiles, 2048,
                                                                                            fits=True)


def amx_like_costs(chunk_steps: int, chunk_per_decode_s: float = 0.0001) -> StepCosts:
    """Decode-only steps of 5 ms + 3 ms a decode; steps with prompt tokens of 20 ms + 0.2 ms a
    prompt token + `chunk_per_decode_s` a decode (one pass over the weights takes every row),
    `chunk_steps` of them beside 1-3 decodes."""
    costs = StepCosts()
    for b in (1, 2, 4, 8, 3, 6, 1, 2):
        costs.observe(b, 0, 0.005 + 0.003 * b)
    for p in (128, 256):
        costs.observe(0, p, 0.020 + 0.0002 * p)
    for i in range(chunk_steps):
        b, p = 1 + i % 3, 16 + 16 * (i % 5)
        costs.observe(b, p, 0.020 + chunk_per_decode_s * b + 0.0002 * p)
    return costs


def test_steps_beside_decodes_are_priced_whole_once_enough_are_measured():
    # a step of P prompt tokens beside B decodes takes 20 ms + 0.1 ms·B + 0.2 ms·P: within
    # 35 ms, 74 tokens beside 1 or 3 decodes
    objective, true_s = 0.035, lambda b, p: 0.020 + 0.0001 * b + 0.0002 * p
    few = amx_like_costs(CHUNK_LINE_STEPS - 1)
    assert few.chunk_step_cost(1, few.prompt_cost()) is None
    # priced on top of what its decodes cost in decode-only steps, a step beside three stops
    # 5 ms short (44 tokens)
    assert true_s(3, prefill_token_budget(objective, 3, few, ceiling=2048)) < objective - 0.005
    costs = amx_like_costs(CHUNK_LINE_STEPS)
    for b in (1, 2, 3):
        tokens = prefill_token_budget(objective, b, costs, ceiling=2048)
        assert 68 <= tokens <= 74
        assert true_s(b, tokens) <= objective


def test_a_whole_step_prices_a_decode_at_most_as_decode_only_steps_do():
    # steps beside decodes that grow by 10 ms a decode (more than decode-only steps' 3 ms) are
    # priced at 3 ms a decode, their mean kept: a noisy fit cannot make decodes dear
    costs = amx_like_costs(CHUNK_LINE_STEPS, chunk_per_decode_s=0.010)
    line = costs.prompt_cost()
    one, three = costs.chunk_step_cost(1, line), costs.chunk_step_cost(3, line)
    assert three.fixed - one.fixed == pytest.approx(0.006, abs=1e-4)
    assert (one.per_token, one.per_context) == (line.per_token, line.per_context)


def test_steps_all_beside_one_batch_size_price_other_decodes_as_decode_only_steps_do():
    # every step beside one decode: d cannot be told, so more decodes cost the decode line's
    # 3 ms each, and the chunk beside eight is the smaller
    costs = StepCosts()
    for b in (1, 2, 4, 8):
        costs.observe(b, 0, 0.005 + 0.003 * b)
    for p in (128, 256):
        costs.observe(0, p, 0.020 + 0.0002 * p)
    for i in range(CHUNK_LINE_STEPS):
        costs.observe(1, 16 + 16 * (i % 5), 0.020 + 0.0002 * (16 + 16 * (i % 5)))
    line = costs.prompt_cost()
    one, eight = costs.chunk_step_cost(1, line), costs.chunk_step_cost(8, line)
    assert eight.fixed - one.fixed == pytest.approx(0.021, abs=1e-4)
    assert prefill_token_budget(0.035, 8, costs, ceiling=2048) < prefill_token_budget(0.035, 1, costs, ceiling=2048)
