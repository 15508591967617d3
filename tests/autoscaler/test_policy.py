"""The decision rule: direction, hysteresis, cooldown, bounds, unknown inputs, explanations."""

import math

from baton.autoscaler.inputs import Action, Mode, Observation, PolicyConfig
from baton.autoscaler.policy import SizingPolicy

DOCS = dict(arrival_rate=80.0, input_len=4500.0, output_len=140.0, hit_rate=0.4)  # prefill-heavy
CHAT = dict(arrival_rate=120.0, input_len=700.0, output_len=850.0, hit_rate=0.5)  # decode-heavy


def _obs(now, x, y, mix=DOCS, **overrides):
    values = dict(now_s=now, prefill_workers=x, decode_workers=y, prefill_supply=27_000.0,
                  step_intercept_s=0.008, step_per_seq_s=6e-5, kv_capacity_tokens=427_000.0, **mix)
    values.update(overrides)
    return Observation(**values)


def _config(**overrides):
    base = dict(ttft_slo_s=1.0, tpot_slo_s=0.05, persist_periods=3, cooldown_s=60.0, urgent_gain=10.0)
    base.update(overrides)
    return PolicyConfig(**base)


def test_prefill_heavy_mix_converts_decode_to_prefill_after_persisting():
    policy = SizingPolicy(_config())
    actions = [policy.decide(_obs(30 * i, 9, 7)).action for i in range(1, 4)]
    assert actions[:2] == [Action.HOLD, Action.HOLD]
    assert actions[2] is Action.CONVERT_DECODE_TO_PREFILL
    last = policy.decide(_obs(120, 10, 6))
    assert last.action is Action.HOLD and "cooldown" in last.explanation


def test_decode_heavy_mix_converts_prefill_to_decode_one_at_a_time():
    policy = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0))
    decision = policy.decide(_obs(30, 12, 4, CHAT))
    assert decision.action is Action.CONVERT_PREFILL_TO_DECODE
    assert decision.target == (11, 5)
    assert decision.desired[0] < 11
    busy = policy.decide(_obs(60, 11, 4, CHAT, conversions_in_flight=1))
    assert busy.action is Action.HOLD and "in flight" in busy.explanation


def test_urgent_gain_acts_without_waiting():
    policy = SizingPolicy(_config(urgent_gain=0.2))
    assert policy.decide(_obs(30, 2, 14)).action is Action.CONVERT_DECODE_TO_PREFILL


def test_balanced_split_holds():
    policy = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0))
    desired = policy.decide(_obs(30, 8, 8)).desired
    steady = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0)).decide(_obs(30, *desired))
    assert steady.action is Action.HOLD
    assert steady.desired == desired


def test_small_gain_inside_margin_holds():
    probe = SizingPolicy(_config()).decide(_obs(30, 8, 8))
    near = (probe.desired[0] + 1, probe.desired[1] - 1)
    policy = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0, min_gain=0.5))
    decision = policy.decide(_obs(30, *near))
    assert decision.action is Action.HOLD and "margin" in decision.explanation


def test_unknown_inputs_hold_the_split():
    policy = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0))
    for bad in (dict(arrival_rate=None), dict(hit_rate=math.nan), dict(step_per_seq_s=None)):
        decision = policy.decide(_obs(30, 2, 14, **bad))
        assert decision.action is Action.HOLD
        assert decision.target == (2, 14)
        assert "unknown" in decision.explanation and next(iter(bad)) in decision.explanation


def test_a_flapping_signal_never_persists():
    policy = SizingPolicy(_config(persist_periods=3, cooldown_s=0.0))
    for i in range(12):
        mix = dict(DOCS, arrival_rate=30.0) if i % 2 else dict(CHAT, arrival_rate=40.0)  # not overloaded
        assert policy.decide(_obs(30 * (i + 1), 8, 8, mix)).action is Action.HOLD


def test_never_empties_a_pool():
    policy = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0, urgent_gain=0.0))
    x, y = 2, 2
    heavy = dict(DOCS, arrival_rate=10_000.0)
    for i in range(10):
        decision = policy.decide(_obs(30 * (i + 1), x, y, heavy))
        x, y = decision.target
        assert x >= 1 and y >= 1


def test_explanation_names_the_driving_inputs():
    policy = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0))
    first = policy.decide(_obs(30, 8, 8, DOCS))  # reference point: nothing moved yet
    assert "inputs arrival_rate=80, input_len=4.5e+03, output_len=140, hit_rate=0.4, " \
           "prefill_supply=2.7e+04" in first.explanation
    decision = policy.decide(_obs(60, 12, 4, CHAT))
    assert decision.action is Action.CONVERT_PREFILL_TO_DECODE
    assert "output_len" in decision.explanation and "input_len" in decision.explanation
    assert decision.outputs["decode_utilisation"] > decision.outputs["prefill_utilisation"]
    as_dict = decision.to_dict()
    assert as_dict["action"] == "convert-prefill-to-decode"
    assert as_dict["inputs"]["output_len"] == CHAT["output_len"]


def test_elastic_mode_scales_pools_within_bounds():
    config = _config(mode=Mode.ELASTIC, persist_periods=1, cooldown_s=0.0,
                     prefill_bounds=(1, 6), decode_bounds=(2, 5))
    decision = SizingPolicy(config).decide(_obs(30, 1, 2, dict(DOCS, arrival_rate=400.0)))
    assert decision.action is Action.SCALE_POOLS
    assert decision.target == (6, 5)
    calm = SizingPolicy(config).decide(_obs(30, 6, 5, dict(DOCS, arrival_rate=0.5)))
    assert calm.action is Action.SCALE_POOLS and calm.target == (1, 2)  # down to the minimums, never empty


def test_a_worker_that_did_not_answer_holds_the_split():
    policy = SizingPolicy(_config(persist_periods=1, cooldown_s=0.0))
    # 0P2D because the prefill worker was too busy to answer: not a pool to refill
    decision = policy.decide(_obs(30, 0, 2, DOCS, unreachable_workers=1))
    assert decision.action is Action.HOLD and decision.target == (0, 2)
    assert "unreachable_workers=1 did not answer" in decision.explanation
    answered = policy.decide(_obs(60, 1, 2, DOCS))
    assert "did not answer" not in answered.explanation and answered.outputs  # sized again
