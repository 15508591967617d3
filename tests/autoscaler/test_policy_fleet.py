"""The decision rule at fleet scale: pace bounded by a share of the source pool, never more
conversions than the persisted shift, streaks that survive a wanted split jittering by a worker."""

from test_policy import _config
from test_policy import _obs as observation

from baton.autoscaler.inputs import Action, PolicyConfig
from baton.autoscaler.policy import SizingPolicy

SCALE = 1000 / 16  # the 16-worker mixes of test_policy, on a 1,000-worker fleet
CHAT = dict(arrival_rate=120.0 * SCALE, input_len=700.0, output_len=850.0, hit_rate=0.5)


def _obs(now, x, y, mix=CHAT, **overrides):
    return observation(now, x, y, mix, **overrides)


def test_conversion_limit_is_a_share_of_the_source_pool_and_at_least_one():
    config = PolicyConfig()
    assert [config.conversion_limit(n) for n in (1, 3, 19, 20, 40, 500)] == [1, 1, 1, 1, 2, 25]
    assert PolicyConfig(max_conversions_in_flight=4).conversion_limit(500) == 4


def test_large_fleet_converts_several_at_once_within_the_share():
    policy = SizingPolicy(_config())
    decisions = [policy.decide(_obs(30 * i, 400, 600)) for i in range(1, 4)]
    assert [d.action for d in decisions[:2]] == [Action.HOLD, Action.HOLD]
    act = decisions[2]
    assert act.action is Action.CONVERT_PREFILL_TO_DECODE
    shift = 400 - act.desired[0]
    assert shift > 20  # the wanted shift is larger than the share allows
    assert act.conversions == 20  # 5% of the 400 prefill workers
    assert act.target == (400 - 20, 600 + 20)
    assert "convert 20 prefill workers to decode" in act.explanation


def test_never_more_conversions_than_the_smallest_shift_of_the_streak():
    policy = SizingPolicy(_config(min_gain=0.0, cooldown_s=0.0))
    desired = policy.decide(_obs(30, 500, 500)).desired
    policy = SizingPolicy(_config(min_gain=0.0, cooldown_s=0.0))
    x = desired[0]
    # The measured split comes closer to the wanted one and moves away again: only the shift
    # wanted in every period of the streak is justified.
    for i, gap in enumerate((20, 6, 15), start=1):
        decision = policy.decide(_obs(30 * i, x + gap, 1000 - x - gap))
    assert decision.action is Action.CONVERT_PREFILL_TO_DECODE
    assert decision.conversions == 6


def test_conversions_in_flight_count_against_the_limit():
    policy = SizingPolicy(_config(persist_periods=1))
    partial = policy.decide(_obs(30, 750, 250, conversions_in_flight=30))
    assert partial.conversions == 37 - 30
    full = SizingPolicy(_config(persist_periods=1)).decide(_obs(30, 750, 250, conversions_in_flight=37))
    assert full.action is Action.HOLD and "in flight" in full.explanation


def test_disruption_budget_caps_the_batch():
    decision = SizingPolicy(_config(persist_periods=1, max_conversions_in_flight=5)).decide(_obs(30, 750, 250))
    assert decision.conversions == 5


def test_a_jittering_wanted_split_keeps_its_streak():
    policy = SizingPolicy(_config())
    rates = (CHAT["arrival_rate"], CHAT["arrival_rate"] * 1.01, CHAT["arrival_rate"] * 0.99)
    decisions = [policy.decide(_obs(30 * i, 400, 600, {**CHAT, "arrival_rate": r}))
                 for i, r in enumerate(rates, start=1)]
    assert len({d.desired for d in decisions}) > 1  # the wanted split moved between periods
    assert decisions[2].action is Action.CONVERT_PREFILL_TO_DECODE


def test_small_fleet_still_converts_one_at_a_time():
    small = dict(CHAT, arrival_rate=120.0)
    decision = SizingPolicy(_config(persist_periods=1)).decide(_obs(30, 12, 4, small))
    assert 12 - decision.desired[0] > 1  # more than one worker is wanted
    assert decision.conversions == 1 and decision.target == (11, 5)


def _after_action(config, conversion_s=None, in_flight=5):
    """A policy that acted at t=30 (20 prefill workers to decode), and its answers at each later
    period while `in_flight` of them are still converting (fewer than the limit of 19)."""
    policy = SizingPolicy(config)
    assert policy.decide(_obs(30, 400, 600)).conversions == 20
    return {t: policy.decide(_obs(t, 380, 620, conversions_in_flight=in_flight, conversion_s=conversion_s))
            for t in range(60, 240, 30)}


def test_quiet_time_follows_the_time_to_convert():
    answers = _after_action(_config(persist_periods=1, cooldown_s=30.0), conversion_s=125.0)
    # Converting takes 125 s: the policy waits for it, past the 30 s floor.
    assert [answers[t].action for t in (60, 90, 120, 150)] == [Action.HOLD] * 4
    assert "converting takes 125s, 35s left" in answers[120].explanation
    assert answers[180].action is Action.CONVERT_PREFILL_TO_DECODE  # 150 s after the action
    # The same fleet with a 50 s conversion acts after 60 s, the next period past it.
    quick = _after_action(_config(persist_periods=1, cooldown_s=30.0), conversion_s=50.0)
    assert quick[60].action is Action.HOLD and quick[90].action is Action.CONVERT_PREFILL_TO_DECODE


def test_configured_estimate_stands_in_until_a_conversion_is_measured():
    config = _config(persist_periods=1, cooldown_s=30.0, conversion_estimate_s=100.0)
    answers = _after_action(config)
    assert answers[120].action is Action.HOLD and "converting takes 100s" in answers[120].explanation
    assert answers[150].action is Action.CONVERT_PREFILL_TO_DECODE
    measured = _after_action(config, conversion_s=20.0)  # a measurement replaces the estimate
    assert measured[60].action is Action.CONVERT_PREFILL_TO_DECODE


def test_cooldown_is_a_floor_under_a_quick_conversion():
    answers = _after_action(_config(persist_periods=1, cooldown_s=120.0), conversion_s=5.0)
    assert [answers[t].action for t in (60, 90, 120)] == [Action.HOLD] * 3
    assert "cooldown, 30s left" in answers[120].explanation
    assert answers[150].action is Action.CONVERT_PREFILL_TO_DECODE  # 120 s after the action
    assert PolicyConfig(cooldown_s=10.0).quiet_s(4.0, 1) == 10.0


def test_finished_conversions_leave_the_floor_alone():
    # Nothing in flight: the conversions have taken effect however long they were expected to
    # take, so a small fleet (one conversion at a time) waits no longer than its cooldown.
    answers = _after_action(_config(persist_periods=1, cooldown_s=30.0, conversion_estimate_s=300.0),
                            conversion_s=300.0, in_flight=0)
    assert answers[60].action is Action.CONVERT_PREFILL_TO_DECODE
    assert PolicyConfig(cooldown_s=10.0, conversion_estimate_s=60.0).quiet_s(None, 0) == 10.0
