"""Monotonicity of the sizing formulas: more load never asks for fewer workers."""

from hypothesis import given, settings
from hypothesis import strategies as st

from baton.autoscaler import sizing

rates = st.floats(0.0, 500.0)
lengths = st.floats(1.0, 50_000.0)
fractions = st.floats(0.0, 0.99)
supplies = st.floats(100.0, 100_000.0)
utilisations = st.floats(0.1, 1.0)


@given(rates, rates, lengths, fractions, supplies, utilisations)
def test_more_load_never_fewer_prefill_workers(r1, r2, length, hit, supply, rho):
    low, high = sorted((r1, r2))
    assert sizing.prefill_pool_size(low, length, hit, supply, rho) <= sizing.prefill_pool_size(high, length, hit, supply, rho)


@given(rates, lengths, fractions, fractions, supplies, utilisations)
def test_higher_hit_rate_never_more_prefill_workers(rate, length, h1, h2, supply, rho):
    low, high = sorted((h1, h2))
    assert sizing.prefill_pool_size(rate, length, high, supply, rho) <= sizing.prefill_pool_size(rate, length, low, supply, rho)


@given(rates, lengths, fractions, supplies, utilisations, utilisations)
def test_higher_target_utilisation_never_more_workers(rate, length, hit, supply, u1, u2):
    low, high = sorted((u1, u2))
    assert sizing.prefill_pool_size(rate, length, hit, supply, high) <= sizing.prefill_pool_size(rate, length, hit, supply, low)


@given(rates, rates, st.floats(0.0, 10.0), lengths, st.floats(0.001, 0.2), st.floats(1.0, 1000.0), utilisations)
def test_more_load_never_fewer_decode_workers(r1, r2, ttft, out_len, tpot, cap, rho):
    low, high = sorted((r1, r2))
    c_low = sizing.decode_concurrency(low, ttft, out_len, tpot)
    c_high = sizing.decode_concurrency(high, ttft, out_len, tpot)
    assert sizing.decode_pool_size(c_low, cap, rho) <= sizing.decode_pool_size(c_high, cap, rho)


@given(rates, st.floats(0.0, 10.0), lengths, lengths, st.floats(0.001, 0.2), st.floats(1.0, 1000.0), utilisations)
def test_longer_outputs_never_fewer_decode_workers(rate, ttft, o1, o2, tpot, cap, rho):
    low, high = sorted((o1, o2))
    c_low = sizing.decode_concurrency(rate, ttft, low, tpot)
    c_high = sizing.decode_concurrency(rate, ttft, high, tpot)
    assert sizing.decode_pool_size(c_low, cap, rho) <= sizing.decode_pool_size(c_high, cap, rho)


@given(st.floats(1e5, 1e7), lengths, lengths, lengths)
def test_more_context_never_larger_kv_batch(capacity, in_len, o1, o2):
    low, high = sorted((o1, o2))
    assert sizing.kv_capacity_batch_bound(capacity, in_len, high) <= sizing.kv_capacity_batch_bound(capacity, in_len, low)


@given(lengths, lengths, st.floats(1e4, 1e6), st.floats(1e9, 1e12))
def test_transfer_time_grows_with_length(l1, l2, kv, link):
    low, high = sorted((l1, l2))
    assert sizing.transfer_seconds(low, kv, link) <= sizing.transfer_seconds(high, kv, link)


@given(st.floats(0.001, 0.1), st.floats(1e-6, 1e-3), st.floats(1e4, 1e6), st.floats(1e9, 1e12), st.floats(1e9, 1e12))
def test_faster_link_never_raises_threshold(overhead, per_token, kv, b1, b2):
    slow, fast = sorted((b1, b2))
    assert sizing.disaggregation_threshold(overhead, per_token, kv, fast) <= sizing.disaggregation_threshold(
        overhead, per_token, kv, slow)


def _load(rate, in_len, out_len, hit):
    return sizing.FleetLoad(arrival_rate=rate, input_len=in_len, output_len=out_len, hit_rate=hit,
                            prefill_supply=20_000, step_intercept_s=0.008, step_per_seq_s=5e-5,
                            kv_capacity_tokens=400_000, exposed_transfer_s=0.001, ttft_slo_s=1.0, tpot_slo_s=0.05)


@settings(max_examples=60, deadline=None)
@given(st.floats(1.0, 100.0), st.floats(1.0, 100.0), st.floats(100, 8000), st.floats(50, 2000), fractions,
       st.integers(1, 31))
def test_more_load_never_more_headroom_for_any_split(r1, r2, in_len, out_len, hit, x):
    low, high = sorted((r1, r2))
    light = sizing.assess_split(_load(low, in_len, out_len, hit), x, 32 - x)
    heavy = sizing.assess_split(_load(high, in_len, out_len, hit), x, 32 - x)
    assert heavy.headroom <= light.headroom + 1e-12
    assert heavy.prefill_utilisation >= light.prefill_utilisation


@settings(max_examples=60, deadline=None)
@given(st.floats(1.0, 60.0), st.floats(500, 8000), st.floats(50, 2000), fractions, fractions)
def test_fixed_split_higher_hit_rate_never_more_prefill(rate, in_len, out_len, h1, h2):
    low, high = sorted((h1, h2))
    x_low_hit = sizing.best_fixed_split(_load(rate, in_len, out_len, low), 32).prefill_workers
    x_high_hit = sizing.best_fixed_split(_load(rate, in_len, out_len, high), 32).prefill_workers
    assert x_high_hit <= x_low_hit


@settings(max_examples=60, deadline=None)
@given(st.floats(1.0, 60.0), st.floats(500, 8000), st.floats(50, 2000), st.floats(50, 2000), fractions)
def test_fixed_split_longer_outputs_never_more_prefill(rate, in_len, o1, o2, hit):
    # (Longer prompts are not monotone: they load decode KV as well as prefill compute.)
    low, high = sorted((o1, o2))
    x_short = sizing.best_fixed_split(_load(rate, in_len, low, hit), 32).prefill_workers
    x_long = sizing.best_fixed_split(_load(rate, in_len, high, hit), 32).prefill_workers
    assert x_long <= x_short


@settings(max_examples=60, deadline=None)
@given(st.floats(0.1, 3000.0), st.floats(50.0, 8000.0), st.floats(10.0, 2000.0), st.floats(0.0, 0.9),
       st.floats(1e-5, 1e-3), st.integers(2, 400))
def test_best_fixed_split_is_the_best_assessed_split(rate, in_len, out_len, hit, per_seq, workers):
    load = _load(rate, in_len, out_len, hit)
    load = sizing.FleetLoad(**{**load.__dict__, "step_per_seq_s": per_seq})
    every = [sizing.assess_split(load, x, workers - x) for x in range(1, workers)]
    pool = [a for a in every if a.meets_slo] or every
    expected = max(pool, key=lambda a: (a.headroom, -a.prefill_workers))
    assert sizing.best_fixed_split(load, workers) == expected
