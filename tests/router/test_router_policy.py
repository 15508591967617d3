"""Routing policy, threshold and admission: pure logic, no servers."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from baton.router.admission import AdmissionQueue, Overloaded
from baton.router.policy import (
    PrefixIndex,
    WorkerSnapshot,
    affinity_slack,
    choose_path,
    local_wait_factor,
    prefill_queue_ahead,
    rank_decode,
    rank_prefill,
)
from baton.router.pool import Membership, WorkerPool, positive_or_none, step_line_or_none
from baton.router.threshold import (
    DEFAULT_STALL_WEIGHT,
    ThresholdEstimator,
    parse_stall_weight,
    parse_threshold,
    stall_weight_for,
    threshold_tokens,
)
from baton.router.worker_metrics import counter_deltas, parse_worker_counters


def w(url, role="decode", **kw) -> WorkerSnapshot:
    return WorkerSnapshot(url=url, role=role, **kw)


def test_decode_prefers_free_kv_then_fewest_running():
    workers = [w("a", running=5), w("b", running=1), w("c", running=0, kv_usage=0.99),
               w("d", role="both", running=1, kv_usage=0.2), w("p", role="prefill")]
    assert [x.url for x in rank_decode(workers)] == ["b", "d", "a", "c"]


def test_router_inflight_counts_as_load():
    workers = [w("a", running=1), w("b", running=0, inflight=3)]
    assert rank_decode(workers)[0].url == "a"


def test_decode_prefers_the_worker_holding_the_prompts_prefix_while_loads_are_near():
    index = PrefixIndex()
    conversation = [11, 22, 33, 44]
    index.record("a", [11, 22, 33])  # the conversation's last turn ran on a
    index.record("b", [11])  # b saw only its system prompt
    ranked = rank_decode([w("a", running=3), w("b", running=2), w("c", running=2)], set(), conversation, index)
    assert [x.url for x in ranked] == ["a", "b", "c"]  # one more than the least busy: within the slack
    ranked = rank_decode([w("a", running=4), w("b", running=2), w("c", running=2)], set(), conversation, index)
    assert [x.url for x in ranked] == ["b", "c", "a"]  # two more: the load decides, so pools stay even
    # the slack grows with the load: a quarter of the least busy worker's requests
    ranked = rank_decode([w("a", running=15), w("b", running=12)], set(), conversation, index)
    assert ranked[0].url == "a"
    assert rank_decode([w("a", running=16), w("b", running=12)], set(), conversation, index)[0].url == "b"


def test_decode_routing_by_prefix_leaves_the_load_order_where_nothing_is_cached_or_the_kv_is_full():
    index = PrefixIndex()
    workers = [w("a", running=1), w("b", running=0, kv_usage=0.5)]
    assert [x.url for x in rank_decode(workers, set(), [7, 8], index)] == ["b", "a"]
    index.record("a", [7, 8])
    assert [x.url for x in rank_decode(workers, set(), [7, 8], index)] == ["a", "b"]
    full = [w("a", running=0, kv_usage=0.99), w("b", running=1)]
    assert [x.url for x in rank_decode(full, set(), [7, 8], index)] == ["b", "a"]  # a would refuse
    assert [x.url for x in rank_decode(workers, {"a"}, [7, 8], index)] == ["b"]


def test_a_burst_goes_where_no_prompt_waits_to_prefill_while_loads_are_near():
    # a freed two slots and took the burst's first prompt; it prefills that one beside its streams
    busy = w("a", role="both", running=2, inflight=1, inflight_prompts=(256,))
    idle = w("b", role="both", running=4)
    index = PrefixIndex()
    assert [x.url for x in rank_decode([busy, idle], set(), [1], index, prompt_tokens=256)] == ["b", "a"]
    assert [x.url for x in rank_decode([busy, idle])] == ["a", "b"]  # routing by load alone
    # two more requests than the least busy: the load decides, prompt work or not
    assert [x.url for x in rank_decode([busy, replace(idle, running=5)], set(), [1], index)] == ["a", "b"]
    # less work waiting first, then fewer requests
    light = w("c", role="both", running=2, inflight=1, inflight_prompts=(64,))
    assert [x.url for x in rank_decode([busy, light, idle], set(), [1], index)] == ["b", "c", "a"]


def test_prompt_work_ahead_counts_what_each_worker_holds_cached():
    index = PrefixIndex()
    turn = list(range(64))  # 64 blocks of 16 tokens: a conversation's history and its new turn
    index.record("a", turn[:60])
    history_here = w("a", role="both", running=2, inflight=1, inflight_prompts=(256,))
    other = w("b", role="both", running=2)
    # 256 waiting + 64 uncached at a, against all 1,024 at b
    assert rank_decode([history_here, other], set(), turn, index, prompt_tokens=1024, block_size=16)[0].url == "a"
    # a short prompt's history is worth less than a prompt waiting ahead of it
    short = list(range(100, 108))
    index.record("a", short[:4])
    assert rank_decode([history_here, other], set(), short, index, prompt_tokens=128, block_size=16)[0].url == "b"


def test_affinity_slack():
    assert [affinity_slack(n) for n in (0, 1, 4, 7, 8, 12, 40)] == [1, 1, 1, 1, 2, 3, 10]


@pytest.mark.parametrize("bad", [dict(state="draining"), dict(state="resharding"), dict(healthy=False)])
def test_draining_or_unhealthy_workers_get_no_work(bad):
    assert [x.url for x in rank_decode([w("a", **bad), w("b", running=9)])] == ["b"]
    assert rank_prefill([w("p", role="prefill", **bad)], [1, 2], PrefixIndex()) == []


def test_prefill_prefers_longest_cached_prefix_then_shortest_queue():
    index = PrefixIndex()
    hashes = [11, 22, 33, 44]
    index.record("p1", [11, 22])
    index.record("p2", [11, 22, 33])
    workers = [w("p1", "prefill"), w("p2", "prefill", waiting=4), w("p3", "prefill")]
    assert [x.url for x in rank_prefill(workers, hashes, index)] == ["p2", "p1", "p3"]
    assert [x.url for x in rank_prefill(workers, [99], index)] == ["p1", "p3", "p2"]
    assert [x.url for x in rank_prefill(workers, hashes, index, exclude={"p2"})] == ["p1", "p3"]


def test_prefix_index_counts_only_the_leading_run_and_evicts_lru():
    index = PrefixIndex(capacity_blocks=3)
    index.record("a", [1, 2, 3])
    assert index.cached_blocks("a", [1, 2, 9, 3]) == 2
    assert index.cached_blocks("a", [9, 1]) == 0
    index.record("a", [4])  # evicts 1, the least recently used
    assert index.cached_blocks("a", [1, 2]) == 0
    index.forget("a")
    assert index.cached_blocks("a", [2]) == 0


def test_conditional_disaggregation():
    assert choose_path(100, 256, True) == "local"
    assert choose_path(256, 256, True) == "remote"
    assert choose_path(5000, 256, False) == "local"  # no prefill pool
    assert choose_path(0, 0, True) == "remote"  # threshold 0 = always disaggregate


def test_threshold_formula():
    # O_fixed 10 ms, local prefill 1 ms/token, transfer 0.5 ms/token -> 20 tokens
    assert threshold_tokens(0.010, 0.001, 500_000, 1e9) == pytest.approx(20.0)
    # transfer per token costlier than computing it: never worth going remote
    assert threshold_tokens(0.010, 0.001, 2e6, 1e9) == math.inf


def test_load_moves_the_threshold():
    # unloaded 20 tokens (above); 3 decodes stalled by a local prefill make it 10 ms / 3.5 ms
    assert threshold_tokens(0.010, 0.001, 500_000, 1e9, decoding=3) == pytest.approx(0.010 / 0.0035)
    # 2,000 prompt tokens queued on the prefill worker: 2 s more before a remote prefill starts
    assert threshold_tokens(0.010, 0.001, 500_000, 1e9, queued_tokens=2000) == pytest.approx(2.010 / 0.0005)
    assert threshold_tokens(0.010, 0.001, 500_000, 1e9, decoding=3, queued_tokens=2000) == pytest.approx(2.010 / 0.0035)


def test_the_prefill_queue_counts_tokens_not_prompts():
    # as measured on one core: 1.7 ms a prompt token, 23 KB of KV a token over ~1 GB/s
    measured = dict(o_fixed_s=0.008, prefill_s_per_token=0.0017, kv_bytes_per_token=23040, link_bytes_per_s=957e6)
    # eight streams decoding, one 2,000-token prefill queued: a 64-token prompt stays home
    # (it would wait 3.4 s there), a second long one still goes away
    behind_a_long_one = threshold_tokens(**measured, decoding=8, queued_tokens=2000)
    assert choose_path(64, behind_a_long_one, True) == "local"
    assert choose_path(2000, behind_a_long_one, True) == "remote"
    # two streams decoding, eight 64-token prompts queued: a 2,000-token prompt goes away
    # (counted as 8 prompts "like this one" it stayed home and stalled the streams for 11 s)
    behind_short_ones = threshold_tokens(**measured, decoding=2, queued_tokens=8 * 64)
    assert choose_path(2000, behind_short_ones, True) == "remote"


def test_a_prompt_waits_for_the_shorter_prompts_queued_and_one_step_of_a_longer_one():
    # the prefill worker takes the prompt with the fewest tokens left first; of a longer
    # prompt, the step under way: half of it expected
    assert prefill_queue_ahead([], 64, 512) == 0
    assert prefill_queue_ahead([2000], 64, 512) == 256  # one chunk of the long one
    assert prefill_queue_ahead([2000], 64, 0) == 1000  # whole prompts: all of it
    assert prefill_queue_ahead([300], 64, 512) == 150  # a longer prompt shorter than a chunk
    assert prefill_queue_ahead([64, 2000, 64, 3000], 64, 512) == 64 + 64 + 256  # equals arrived first
    assert prefill_queue_ahead([64, 100, 3000], 2000, 512) == 64 + 100 + 256
    # measured on one core: eight streams decoding, a 2,000-token prompt under way in
    # 512-token chunks; a 64-token prompt expects half a chunk there (0.4 s) and goes away,
    # where waiting for all of it (3.4 s) kept it home to stall the eight streams
    measured = dict(o_fixed_s=0.008, prefill_s_per_token=0.0017, kv_bytes_per_token=23040, link_bytes_per_s=957e6)
    ahead = prefill_queue_ahead([2000], 64, 512)
    assert choose_path(64, threshold_tokens(**measured, decoding=8, queued_tokens=ahead), True) == "remote"
    assert choose_path(64, threshold_tokens(**measured, decoding=8, queued_tokens=2000), True) == "local"


def test_a_prompt_kept_home_waits_for_the_decodes_steps_too():
    line = (0.004, 0.002)  # a decode step: 4 ms, and 2 ms a decode
    # beside five decodes (14 ms) under a 30 ms objective a step carries 16 ms of prompt work
    assert local_wait_factor(5, 0.030, line) == pytest.approx(0.030 / 0.016)
    assert local_wait_factor(9, 0.030, line) == pytest.approx(0.030 / 0.008)  # fewer left: longer
    assert local_wait_factor(12, 0.030, line) == 8.0  # next to nothing left: capped
    assert local_wait_factor(13, 0.030, line) == 3.0  # decodes alone past it: half a step's prompt work
    # the prompt runs whole, or nothing paces it, or nothing is measured: its compute alone
    assert local_wait_factor(0, 0.030, line) == 1.0
    assert local_wait_factor(5, None, line) == local_wait_factor(5, 0.0, line) == 1.0
    assert local_wait_factor(5, 0.030, None) == 1.0


def test_the_wait_beside_decodes_moves_prompts_away_and_not_the_stall():
    # the decision of a P/D round on a Xeon (bench/serving.py) that kept a 256-token prompt
    # home: three streams decoding, two prompts queued on the prefill worker
    measured = dict(o_fixed_s=0.087, prefill_s_per_token=0.000374, kv_bytes_per_token=23040,
                    link_bytes_per_s=2.0e9)
    load = dict(decoding=3, queued_tokens=512, held_prompts=0.22, local_s_per_token=0.000533, stall_weight=0.2)
    priced_at_compute = threshold_tokens(**measured, **load)
    assert choose_path(256, priced_at_compute, True) == "local"  # 338 tokens, as the router recorded
    factor = local_wait_factor(3, 0.030, (0.0055, 0.0019))  # its 11 ms steps of three decodes
    with_the_wait = threshold_tokens(**measured, **load, local_wait_factor=factor)
    assert choose_path(256, with_the_wait, True) == "remote"
    waited = 0.000533 * factor  # the wait scaled, the decodes' stall (its compute) not
    gain = waited + 0.000533 * 0.2 * 3 - 23040 / 2.0e9 - 0.2 * 0.22 * 0.000374
    assert with_the_wait == pytest.approx((0.087 + 512 * 0.000374) / gain)
    # a prompt already waiting there waits at that pace too
    queued_home = threshold_tokens(**measured, **load, local_queued_tokens=256, local_wait_factor=factor)
    assert queued_home == pytest.approx((0.087 + 512 * 0.000374 - 256 * waited) / gain)
    assert threshold_tokens(**measured, **load, local_wait_factor=0.5) == priced_at_compute  # never below 1


def test_a_decode_step_line_from_a_workers_state():
    assert step_line_or_none([0.004, 0.002]) == (0.004, 0.002)
    assert step_line_or_none([0, 0.002]) == (0.0, 0.002)
    for bad in (None, [], [0.004], [0.004, -1.0], [0.004, float("nan")], ["a", 1], [True, 1], "0.004,0.002"):
        assert step_line_or_none(bad) is None


def test_the_pool_keeps_each_outstanding_prompt_it_sent_to_prefill():
    pool = WorkerPool(client=None)
    pool.set_members([Membership("p", "prefill")])
    pool.begin("p", 2000)
    pool.begin("p", 64)
    pool.begin("p")  # a request with nothing to prefill there
    assert pool.snapshots()[0].inflight_prompts == (2000, 64) and pool.snapshots()[0].inflight == 3
    pool.end("p", 2000)
    pool.end("p")
    assert pool.snapshots()[0].inflight_prompts == (64,) and pool.snapshots()[0].inflight == 1
    pool.end("p", 64)
    pool.end("p", 64)  # ended twice: nothing below zero
    assert pool.snapshots()[0].inflight_prompts == () and pool.snapshots()[0].inflight == 0


def test_a_local_prompt_stops_counting_as_prompt_work_at_its_first_token():
    pool = WorkerPool(client=None)
    pool.set_members([Membership("c", "both")])
    pool.begin("c", 256)
    pool.prefilled("c", 256)
    assert pool.snapshots()[0].inflight_prompts == () and pool.snapshots()[0].inflight == 1
    pool.end("c", 0)
    assert pool.snapshots()[0].inflight == 0


def test_busy_decode_worker_and_idle_prefill_pool_send_short_prompts_away():
    est = ThresholdEstimator(fallback=512, stall_weight=1.0)
    assert est.threshold(decoding=7) == pytest.approx(64)
    assert choose_path(256, est.threshold(decoding=7), True) == "remote"
    assert choose_path(256, est.threshold(decoding=0), True) == "local"
    assert est.threshold(decoding=0, queued_tokens=1000) == pytest.approx(1512)
    # prompts already waiting to prefill where it decodes count against home, as measured
    assert est.threshold(decoding=1, local_queued_tokens=300) == pytest.approx((512 - 300) / 2)
    assert est.threshold(decoding=1, local_queued_tokens=900) == 0.0
    assert ThresholdEstimator(fixed=300).threshold(decoding=50) == 300  # a fixed threshold is fixed
    # unmeasured, a prompt kept home still waits for the decodes' steps: a cold router's first
    # burst kept every other prompt home, the fourth of them first after 1.2-1.5 s (a Xeon, P/D)
    cold = ThresholdEstimator(fallback=512)  # at the router's own weight, 0.2
    assert cold.threshold(decoding=2, queued_tokens=256, local_queued_tokens=256) == pytest.approx(512 / 1.4)
    slowed = cold.threshold(decoding=2, queued_tokens=256, local_queued_tokens=256, local_wait_factor=1.5)
    assert slowed == pytest.approx((768 - 256 * 1.5) / (1.5 + 0.4))
    assert choose_path(256, slowed, True) == "remote" and choose_path(256, 512 / 1.4, True) == "local"


def test_the_stall_weight_scales_what_a_prompt_costs_others():
    # a P/D round's decision on a Zen 4 (bench/serving.py): five streams decoding, two prompts
    # queued at the prefill worker, ~1.7 prompts a remote one would hold up
    measured = dict(o_fixed_s=0.0136, prefill_s_per_token=0.001147, kv_bytes_per_token=23040,
                    link_bytes_per_s=1.0e9)
    load = dict(decoding=5, queued_tokens=512, held_prompts=1.7, local_s_per_token=0.00103)
    everyone_alike = threshold_tokens(**measured, **load, stall_weight=1.0)
    assert everyone_alike == pytest.approx(0.6009 / (0.00103 * 6 - 23040 / 1e9 - 1.7 * 0.001147), rel=1e-3)
    assert choose_path(256, everyone_alike, True) == "remote"  # ~143 tokens
    own_first = threshold_tokens(**measured, **load, stall_weight=0.2)
    assert choose_path(256, own_first, True) == "local"  # ~365: the remote queue's 0.6 s counts more
    # w = 0: only the prompt's own waits and costs; more weight, a lower threshold
    alone = threshold_tokens(**measured, queued_tokens=512, local_s_per_token=0.00103)
    assert threshold_tokens(**measured, **load, stall_weight=0.0) == pytest.approx(alone)
    assert alone > own_first > threshold_tokens(**measured, **load, stall_weight=0.5) > everyone_alike
    assert threshold_tokens(**measured, **load) == everyone_alike  # the formula's own default: 1
    # the estimator carries its weight into the formula and into the fallback before measurements
    est = ThresholdEstimator(fallback=512, stall_weight=0.5)
    assert est.threshold(decoding=6) == pytest.approx(512 / 4)
    est.o_fixed_s.observe(0.0136), est.observe_prefill_rate(0.001147), est.observe_transfer(23040, 23040 / 1e9, tokens=1)
    assert est.threshold(**load) == pytest.approx(threshold_tokens(**measured, **load, stall_weight=0.5))
    assert ThresholdEstimator().stall_weight == DEFAULT_STALL_WEIGHT and est.explain()["stall_weight"] == 0.5


def test_a_prompt_longer_than_the_prefill_chunk_is_placed_at_weight_one():
    assert stall_weight_for(0.2, 512, 512) == 0.2 and stall_weight_for(0.2, 513, 512) == 1.0
    assert stall_weight_for(0.2, 2000, 0) == 0.2  # no chunk known: the router's weight
    # decodes that alone outrun their objective: no budget keeps them within it, so in full
    assert stall_weight_for(0.2, 256, 512, decodes_past_objective=True) == 1.0
    # a 2,000-token prompt behind two more at the prefill worker, five streams decoding: at
    # 0.2 it would prefill beside them (threshold ~2,260), at 1 it goes away (~750)
    est = ThresholdEstimator(stall_weight=0.2)
    est.o_fixed_s.observe(0.0136), est.observe_prefill_rate(0.001147), est.observe_transfer(23040, 23040 / 1e9, tokens=1)
    load = dict(decoding=5, queued_tokens=4000, local_s_per_token=0.00103)
    assert choose_path(2000, est.threshold(**load), True) == "local"
    assert choose_path(2000, est.threshold(**load, stall_weight=stall_weight_for(0.2, 2000, 512)), True) == "remote"


@pytest.mark.parametrize("given, weight", [(None, DEFAULT_STALL_WEIGHT), ("", DEFAULT_STALL_WEIGHT), (" ", DEFAULT_STALL_WEIGHT),
                                           ("0", 0.0), ("1", 1.0), (0.3, 0.3)])
def test_a_stall_weight_is_read_as_a_number(given, weight):
    assert parse_stall_weight(given) == weight


@pytest.mark.parametrize("given", ["-1", "nan", "inf", "much", -0.1])
def test_a_stall_weight_below_zero_or_not_a_number_is_refused_by_name(given):
    with pytest.raises(ValueError, match=r"--stall-weight, BATON_STALL_WEIGHT\) must be a number >= 0"):
        parse_stall_weight(given)


def test_the_prefill_workers_own_rate_feeds_the_threshold():
    est = ThresholdEstimator()
    est.observe_prefill_rate(0.002)
    est.observe_prefill_rate(0.0)  # not measured yet: ignored
    assert est.prefill_s_per_token.value == pytest.approx(0.002)


def test_the_decode_workers_own_prompt_cost_is_the_local_side():
    # 1 ms a token at the prefill worker, but 3 ms where it decodes (small chunks under the
    # TPOT cap): 10 ms / (3 - 0.5) ms = 4 tokens, and 3 decodes stalled: 10 / (12 - 0.5)
    assert threshold_tokens(0.010, 0.001, 500_000, 1e9, local_s_per_token=0.003) == pytest.approx(4.0)
    assert threshold_tokens(0.010, 0.001, 500_000, 1e9, decoding=3,
                            local_s_per_token=0.003) == pytest.approx(0.010 / 0.0115)
    # the queue ahead at the prefill worker still costs its own rate
    assert threshold_tokens(0.010, 0.001, 500_000, 1e9, queued_tokens=100,
                            local_s_per_token=0.003) == pytest.approx(0.110 / 0.0025)
    for unknown in (None, 0.0):  # not measured there: the prefill worker's rate stands in
        assert threshold_tokens(0.010, 0.001, 500_000, 1e9, local_s_per_token=unknown) == pytest.approx(20.0)
    est = ThresholdEstimator()
    est.o_fixed_s.observe(0.010), est.observe_prefill_rate(0.001), est.observe_transfer(500_000, 5e-4, tokens=1)
    assert est.threshold(local_s_per_token=0.003) == pytest.approx(4.0)
    assert est.threshold() == pytest.approx(20.0)
    # one core each: with four streams decoding, a 256-token prompt behind a 2,000-token
    # prefill stays home at the prefill worker's 1.7 ms a token (threshold ~436), and goes
    # away where the decode worker's chunks cost it 6 ms a token (threshold ~123)
    measured = dict(o_fixed_s=0.3, prefill_s_per_token=0.0017, kv_bytes_per_token=23040, link_bytes_per_s=957e6)
    assert choose_path(256, threshold_tokens(**measured, decoding=4, queued_tokens=2000), True) == "local"
    assert choose_path(256, threshold_tokens(**measured, decoding=4, queued_tokens=2000,
                                             local_s_per_token=0.006), True) == "remote"


def test_a_workers_measured_rate_is_read_only_when_it_is_one():
    assert positive_or_none(0.002) == 0.002 and positive_or_none(3) == 3.0
    for nonsense in (None, 0, -1.0, float("nan"), float("inf"), True, "0.002"):
        assert positive_or_none(nonsense) is None


def test_current_counts_the_routers_own_requests_once():
    # the poll's five were all this router's: not ten
    assert WorkerSnapshot("a", "decode", running=4, waiting=1, inflight=5, inflight_at_poll=5).current == 5
    # never fewer than its own outstanding ones, however stale the poll
    assert WorkerSnapshot("a", "decode", running=0, inflight=2, inflight_at_poll=6).current == 2
    # what the poll saw that this router did not send stays counted
    assert WorkerSnapshot("a", "decode", running=2, waiting=1, inflight=5).current == 8
    # reservations for prompts prefilling elsewhere are requests that will decode there
    assert WorkerSnapshot("a", "decode", running=1, reserved=3).current == 4


def test_current_moves_the_polled_count_by_the_requests_begun_or_ended_since():
    # polled with 4 running, all 4 this router's; 3 ended since, 2 new ones begun
    assert WorkerSnapshot("a", "decode", running=4, inflight=3, inflight_at_poll=4).current == 3
    assert WorkerSnapshot("a", "decode", running=4, inflight=0, inflight_at_poll=4).current == 0
    assert WorkerSnapshot("a", "decode", running=1, inflight=3, inflight_at_poll=0).current == 4
    assert WorkerSnapshot("a", "decode", running=0, inflight=2, inflight_at_poll=3).current == 2


def test_a_burst_sharing_a_system_prompt_right_after_other_work_spreads_evenly():
    """The last poll saw four requests running on each worker, since ended; then eight
    prompts with one system prompt arrive at once. By the stale poll's count each worker
    looked four busy however many were sent to it, and the first to hold the system prompt
    took six."""
    index, system, sent = PrefixIndex(), list(range(16)), {"a": 0, "b": 0}
    for i in range(8):
        workers = [w(u, role="both", running=4, inflight=sent[u], inflight_at_poll=4) for u in "ab"]
        chosen = rank_decode(workers, set(), [*system, 100 + i], index)[0].url
        index.record(chosen, [*system, 100 + i])
        sent[chosen] += 1
    assert sent == {"a": 4, "b": 4}


def test_estimator_falls_back_until_measured_then_follows_measurements():
    est = ThresholdEstimator(fallback=512)
    assert est.threshold() == 512
    est.observe_prefill(1000, 1.0)  # 1 ms/token
    est.observe_transfer(1e6, 0.002, tokens=1000)  # 1 kB/token at 500 MB/s -> 2 us/token
    assert est.threshold() == 512  # overhead not yet seen
    est.observe_remote(1000, 1.0 + 0.002 + 0.010)  # 10 ms unexplained
    assert est.threshold() == pytest.approx(0.010 / (0.001 - 0.000002), rel=1e-6)
    assert ThresholdEstimator(fixed=64).threshold() == 64


def test_the_prefill_workers_queue_and_shared_steps_are_not_fixed_overhead():
    est = ThresholdEstimator()
    est.observe_prefill_rate(0.001)
    est.observe_transfer(1e6, 0.002, tokens=1000)
    # a 256-token prompt that waited behind six others in one shared step: 1.5 s on the worker
    est.observe_remote(256, 1.5 + 0.010 + 256 * 0.000002, worker_s=1.5)
    assert est.o_fixed_s.value == pytest.approx(0.010)


def test_parse_threshold():
    assert parse_threshold("auto") is None and parse_threshold(None) is None
    assert parse_threshold("128") == 128.0
    for bad in ("-3", "nan", "abc", "12 tokens"):
        with pytest.raises(ValueError, match=f"got '{bad}'"):
            parse_threshold(bad)


def test_worker_counters_and_deltas():
    text = ("# TYPE baton_prompt_tokens_total counter\n"
            'baton_prompt_tokens_total{role="prefill"} 300\n'
            "# TYPE baton_prefill_busy_seconds_total counter\n"
            'baton_prefill_busy_seconds_total{role="prefill"} 1.5\n'
            "# TYPE baton_kv_transfer_seconds histogram\n"
            'baton_kv_transfer_seconds_sum{role="prefill"} 0.25\n'
            'baton_kv_transfer_seconds_count{role="prefill"} 3\n')
    now = parse_worker_counters(text)
    assert now == {"prompt_tokens": 300, "prefill_busy_s": 1.5}  # transfer spans are paced by compute
    assert counter_deltas({"prompt_tokens": 100.0}, {"prompt_tokens": 300.0}) == {"prompt_tokens": 200.0}
    assert counter_deltas({"prompt_tokens": 500.0}, {"prompt_tokens": 30.0}) == {"prompt_tokens": 30.0}


def test_admission_queue_bounds_and_retry_after():
    async def scenario():
        queue = AdmissionQueue(max_running=1, max_waiting=1, wait_timeout_s=5)
        await queue.acquire()
        waiter = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0.01)
        assert queue.waiting == 1
        with pytest.raises(Overloaded) as refused:
            await queue.acquire()
        assert refused.value.retry_after_s >= 1
        queue.release(0.5)
        await asyncio.wait_for(waiter, 1)
        assert queue.running == 1 and queue.waiting == 0

    asyncio.run(scenario())
