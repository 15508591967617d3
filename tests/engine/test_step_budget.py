"""The TPOT budget for prompt tokens: measured step costs in, prompt tokens per step out
(the decode line, row tiles, the scheduler's cap; chunk costs: test_step_budget_chunks.py)."""

from __future__ import annotations

import pytest

from baton.engine.config import EngineConfig
from baton.engine.step_budget import (
    MIN_PROMPT_TOKENS_PER_STEP,
    RATE_STEPS,
    UNREACHABLE_SHARE,
    RowTiles,
    StepCosts,
    decodes_past_objective,
    on_row_tiles,
    prefill_token_budget,
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


def test_a_prompt_step_within_the_decode_lines_fixed_part_sets_no_rate():
    costs = StepCosts()
    for b in (1, 4):
        costs.observe(b, 0, 0.010 + 0.002 * b)  # t_dec(0) = 10 ms
    costs.observe(0, 4, 0.008)  # four prompt tokens alone, under the line's fixed part
    assert costs.prefill_s_per_token is None
    costs.observe(0, 64, 0.030)
    assert costs.prefill_s_per_token == pytest.approx(0.020 / 64)


def test_the_rate_is_the_recent_steps_seconds_over_their_tokens():
    costs = StepCosts()
    for b in (2, 6):
        costs.observe(b, 0, 0.004 + 0.002 * b)  # t_dec(B) = 4 ms + 2 ms a decode
    for _ in range(8):
        costs.observe(6, 28, 0.016 + 28 * 0.0003)  # 28-token chunks beside six decodes, 0.3 ms a token
    assert costs.prefill_s_per_token == pytest.approx(0.0003)
    # a 4-token chunk whose step ran 6 ms long (a neighbour took the core): counted by its
    # tokens, it moves the rate by ~2%, where one smoothed sample of 1.8 ms a token moved it 2x
    costs.observe(6, 4, 0.016 + 4 * 0.0003 + 0.006)
    assert costs.prefill_s_per_token == pytest.approx((8 * 28 * 0.0003 + 4 * 0.0003 + 0.006) / (8 * 28 + 4))
    assert costs.prefill_s_per_token < 0.00033
    for _ in range(RATE_STEPS):  # only the last RATE_STEPS steps count
        costs.observe(6, 28, 0.016 + 28 * 0.0005)
    assert costs.prefill_s_per_token == pytest.approx(0.0005)
    costs.forget_prefill_rate()
    assert costs.prefill_s_per_token is None


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


def test_decodes_past_the_objective_are_told_by_their_own_line():
    costs = costs_of(0.010, 0.004, 0.0001)  # 8 decodes: 42 ms a step
    assert decodes_past_objective(costs, 8, 0.030) and not decodes_past_objective(costs, 4, 0.030)
    assert not decodes_past_objective(costs, 8, 0.050)
    assert not decodes_past_objective(costs, 8, None) and not decodes_past_objective(costs, 8, 0.0)  # no objective
    assert not decodes_past_objective(StepCosts(), 8, 0.030)  # nothing measured


def test_tokens_that_fit_move_down_to_a_row_tiles_end_and_forced_ones_up():
    tiles = RowTiles(8, from_rows=16)
    # 4 decodes + 14 tokens = 18 rows: the third tile would cost a whole one, past the allowance
    assert on_row_tiles(14, 4, tiles, ceiling=512, fits=True) == 12
    # raised to 16 past what fits anyway: the rest of the third tile is nearly free
    assert on_row_tiles(16, 4, tiles, ceiling=512, fits=False) == 20
    assert on_row_tiles(16, 4, tiles, ceiling=18, fits=False) == 18  # never past the ceiling
    assert on_row_tiles(12, 4, tiles, ceiling=512, fits=False) == 12  # already whole tiles
    assert on_row_tiles(20, 4, tiles, ceiling=20, fits=True) == 20  # the ceiling, not a fit
    assert on_row_tiles(3, 4, tiles, ceiling=512, fits=True) == 3  # below the tiled products
    assert on_row_tiles(6, 12, tiles, ceiling=512, fits=True) == 4
    assert on_row_tiles(1, 16, tiles, ceiling=512, fits=True) == 1  # a prompt always advances
    assert on_row_tiles(14, 4, None, ceiling=512, fits=True) == 14
    assert on_row_tiles(14, 4, RowTiles(1), ceiling=512, fits=True) == 14


def test_the_budget_counts_a_steps_rows_in_whole_tiles():
    costs = costs_of(0.02, 0.005, 0.001)
    # 8 decodes take 60 ms; 40 tokens fit a 100 ms objective: 48 rows, six whole tiles
    fitted = prefill_token_budget(0.1, 8, costs, ceiling=2048)
    tiled = prefill_token_budget(0.1, 8, costs, ceiling=2048, tiles=RowTiles(16, from_rows=16))
    assert (8 + tiled) % 16 == 0 and fitted - 16 < tiled <= fitted
    # decodes alone past the objective: the forced tokens fill their last tile
    lost = costs_of(0.2, 0.05, 0.1)
    forced = prefill_token_budget(0.1, 6, lost, ceiling=2048, tiles=RowTiles(8, from_rows=8))
    assert MIN_PROMPT_TOKENS_PER_STEP < forced < MIN_PROMPT_TOKENS_PER_STEP + 8 and (6 + forced) % 8 == 0


def test_one_batch_size_seen_scales_with_the_batch():
    costs = StepCosts()
    for _ in range(5):
        costs.observe(4, 0, 0.04)
    assert costs.decode_step_s(8) == pytest.approx(0.08)
    costs.observe(4, 0, float("nan"))
    costs.observe(0, 0, 1.0)
    assert costs.decode_step_s(4) == pytest.approx(0.04)


def test_one_slow_step_does_not_tilt_the_decode_line():
    """A step the machine slowed (here one stream's, at 3x) is outvoted by the others at
    its batch size: the line still rises with the batch rather than going flat."""
    costs = StepCosts()
    for b in (1, 4, 8):
        for i in range(3):
            costs.observe(b, 0, (0.008 + 0.0015 * b) * (3.0 if (b, i) == (1, 0) else 1.0))
    assert costs.decode_step_s(1) == pytest.approx(0.0095)
    assert costs.decode_step_s(8) == pytest.approx(0.020)


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

    # a prompt of ~290 tokens, several chunks of half a decode step (12 sentences fit in two
    # on a Xeon with AMX, where a decode step is slow beside its prompt tokens' cost)
    engine, greedy = engine_fp32, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short, long = "Budgets:", "Seven tall ships sailed past the harbour wall at dawn. " * 24
    monkeypatch.setattr(engine.config, "tpot_objective_s", 1e-6)
    seen, bounds = [], []  # each step's batch; half a decode step in prompt tokens, as costs stood
    schedule = engine.scheduler.schedule

    def recorded(cap=None, admission_cap=None):
        costs, decodes = engine.step_costs, engine.scheduler.num_decoding()
        if decodes and costs.prompt_cost() and costs.decode_step_s(decodes) is not None:
            bounds.append(max(MIN_PROMPT_TOKENS_PER_STEP,
                              UNREACHABLE_SHARE * costs.decode_step_s(decodes) / costs.prompt_cost()[1]))
        else:
            bounds.append(None)  # nothing measured yet: no cap
        seen.append(schedule(cap, admission_cap))
        return seen[-1]

    monkeypatch.setattr(engine.scheduler, "schedule", recorded)
    engine.add_request(short, greedy, request_id="budget-short")
    for _ in range(3):
        engine.step()
    engine.add_request(long, greedy, request_id="budget-long")
    results = {}
    while engine.has_unfinished():
        results.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    for rid in ("budget-short", "budget-long"):  # the engine is shared: leave nothing behind
        engine.release(rid)
    beside = [(b.num_tokens - len(b.decodes), bound) for b, bound in zip(seen[3:], bounds[3:])
              if b.decodes and b.prefills]
    assert len(beside) >= 3, "the long prompt should have run in several chunks"
    # the objective is unreachable: half a measured decode step at most, never a wait
    assert all(bound is not None and tokens <= bound + 1 for tokens, bound in beside), beside
    carried = [bool(b.prefills) for b in seen[3:]]
    assert carried == sorted(carried, reverse=True), "every step carried the prompt until it was in"
    alone = [out.token_ids for out in engine.generate([short, long], greedy)]
    assert [results["budget-short"], results["budget-long"]] == alone


def test_the_engine_fills_the_row_tile_of_a_chunk_it_forces_past_the_objective(engine_fp32, monkeypatch):
    """Products that take rows 8 at a time: beside a decoding request, each chunk of a long
    prompt (but its last) makes the step's rows a whole number of tiles."""
    from baton.engine.sampling import SamplingParams

    engine, greedy = engine_fp32, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(engine.config, "tpot_objective_s", 1e-6)  # unreachable: chunks are forced
    monkeypatch.setattr(engine.runner, "row_tiles", RowTiles(8))
    chunks = []  # (decodes, prompt tokens, the prompt's tokens left past its chunk) of each step beside decodes
    schedule = engine.scheduler.schedule

    def recorded(*args):
        batch = schedule(*args)
        if batch.decodes and batch.prefills:
            seq, tokens = batch.prefills[0]
            chunks.append((len(batch.decodes), tokens, seq.num_uncomputed_tokens - tokens))
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", recorded)
    engine.add_request("Tiles:", greedy, request_id="tiles-short")
    for _ in range(3):
        engine.step()
    # a prompt of its own: the engine is shared, and a prompt it has cached would skip its chunks
    engine.add_request("Nine quiet boats drifted along the river bank at noon. " * 24, greedy,
                       request_id="tiles-long")
    while engine.has_unfinished():
        engine.step()
    for rid in ("tiles-short", "tiles-long"):
        engine.release(rid)
    assert len(chunks) >= 3, chunks
    assert all((decodes + tokens) % 8 == 0 for decodes, tokens, left in chunks if left > 0), chunks
    assert chunks[-1][2] == 0  # the last: whatever was left
