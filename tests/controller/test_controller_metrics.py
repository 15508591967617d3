"""Metrics sources: the PromQL text, the reduction to a snapshot, and scraping real /metrics."""

from __future__ import annotations

import math

import pytest
from fleet_harness import FakeWorker, Traffic, WorkerMetrics, running_workers

from baton.autoscaler.estimate import ObservationBuilder, PoolState
from baton.autoscaler.metrics import COUNTERS, GAUGES, SeriesRates, summarise, window_batch
from baton.autoscaler.metrics_prometheus import series_from_results
from baton.autoscaler.metrics_scrape import (
    ScrapeSource,
    counter_rate,
    parse_exposition,
    series_rates,
    window_start,
)
from baton.autoscaler.promql import (
    check_window,
    counter_rate_query,
    deployment_matchers,
    gauge_query,
    role_query,
    snapshot_queries,
)


def test_counter_query_text():
    assert counter_rate_query("baton_prompt_tokens_total", "30s") == (
        "sum by (instance, role) (rate(baton_prompt_tokens_total[30s]))")
    assert counter_rate_query("baton_prompt_tokens_total", "1m", "pod", 'namespace="ml"') == (
        'sum by (pod, role) (rate(baton_prompt_tokens_total{namespace="ml"}[1m]))')


def test_gauge_and_role_query_text():
    assert gauge_query("baton_kv_cache_usage_ratio") == (
        "sum by (instance, role) (baton_kv_cache_usage_ratio)")
    assert role_query("pod", 'namespace="ml"') == (
        'max by (pod, role) (baton_worker_role{namespace="ml"})')


def test_snapshot_queries_cover_every_input():
    queries = snapshot_queries("2m")
    assert set(queries) == set(COUNTERS.values()) | set(GAUGES.values()) | {"role"}
    assert "rate(baton_e2e_request_latency_seconds_count[2m])" in queries["requests"]
    assert "rate(baton_inter_token_latency_seconds_sum[2m])" in queries["itl_sum"]


@pytest.mark.parametrize("window", ["", "1", "5 m", "1m;drop", "m"])
def test_bad_windows_are_refused(window):
    with pytest.raises(ValueError):
        check_window(window)


def test_deployment_matchers_scope_to_worker_pods():
    assert deployment_matchers("ml", "demo.x") == r'namespace="ml",pod=~"demo\.x-w-.*"'


def _series(worker, role, **values):
    return SeriesRates(worker=worker, role=role, current=True, **values)


def test_summary_computes_the_fleet_inputs():
    snap = summarise([
        _series("p", "prefill", prompt_tokens=6000.0, prefill_busy=0.5, prefix_queries=8000.0,
                prefix_hits=2000.0, running=1.0, waiting=2.0),
        _series("d1", "decode", requests=2.0, generation_tokens=100.0, itl_sum=2.0,
                itl_count=100.0, running=4.0, kv_usage=0.5),
        _series("d2", "decode", requests=2.0, generation_tokens=100.0, itl_sum=3.0,
                itl_count=100.0, running=6.0, kv_usage=0.3),
    ])
    assert snap.arrival_rate == 4.0
    assert snap.input_len == 2000.0
    assert snap.output_len == 50.0
    assert snap.hit_rate == 0.25
    assert snap.prefill_supply == 12000.0
    assert snap.decode_kv_usage == pytest.approx(0.4)
    assert snap.decode_running == 5.0
    assert {(s.worker, s.batch, s.step_s) for s in snap.step_samples} == {
        ("d1", 4.0, 0.02), ("d2", 6.0, 0.03)}
    assert snap.pools == {"prefill": 1, "decode": 2, "both": 0}
    assert snap.waiting == {"prefill": 2.0, "decode": None}


def test_lengths_come_from_the_finished_requests_where_workers_count_them():
    """A window as the long prompts give way to short ones: prompt tokens still being looked up
    and outputs still being generated, over the few requests that finished, would read
    prompts and outputs longer than any sent; the finished requests' own lengths cannot."""
    shifting = [
        _series("p", "prefill", prompt_tokens=600.0, prefill_busy=1.0, prefix_queries=600.0, prefix_hits=0.0),
        _series("d", "decode", requests=0.2, generation_tokens=85.0, finished_prompt_tokens=130.0,
                finished_generation_tokens=12.0),
    ]
    snap = summarise(shifting)
    assert snap.input_len == pytest.approx(650.0) and snap.output_len == pytest.approx(60.0)
    # workers that do not count them: the window's ratios
    older = summarise([_series("p", "prefill", prefix_queries=600.0),
                       _series("d", "decode", requests=0.2, generation_tokens=85.0)])
    assert older.input_len == pytest.approx(3000.0) and older.output_len == pytest.approx(425.0)


def test_unknown_and_nan_are_none_never_zero():
    snap = summarise([
        _series("p", "prefill", prompt_tokens=0.0, prefill_busy=0.0, prefix_queries=math.nan),
        _series("d", "decode", requests=0.0, generation_tokens=0.0, running=math.nan),
    ])
    assert snap.arrival_rate == 0.0  # measured: no traffic
    for name in ("input_len", "output_len", "hit_rate", "prefill_supply", "exposed_transfer_s",
                 "decode_running", "decode_kv_usage"):
        assert getattr(snap, name) is None, name
    assert snap.step_samples == ()
    assert summarise([]).arrival_rate is None


def test_supply_falls_back_to_local_prefill_and_old_role_series_count():
    snap = summarise([
        # converted from decode: its old series still carry the requests it finished
        _series("w", "prefill", prefill_busy=0.0, prompt_tokens=0.0),
        SeriesRates("w", "decode", current=False, requests=1.0, prompt_tokens=900.0,
                    prefill_busy=0.1),
    ])
    assert snap.prefill_supply == 9000.0
    assert snap.arrival_rate == 1.0
    assert snap.pools["prefill"] == 1 and snap.pools["decode"] == 0
    assert snap.local_share == 1.0


def test_a_decode_worker_idle_at_the_scrape_still_gives_a_step_sample():
    # short outputs: the worker decoded during the window but runs nothing at the scrape
    snap = summarise([_series("d", "decode", requests=1.0, generation_tokens=6.0, itl_sum=0.4,
                              itl_count=5.0, running=0.0, kv_usage=0.0, kv_capacity=8192.0)])
    assert [(s.batch, s.step_s) for s in snap.step_samples] == [(1.0, pytest.approx(0.08))]
    assert snap.decode_kv_capacity == 8192.0
    assert window_batch(3.0, 1.5) == 3.0  # the gauge, when it shows sequences
    assert window_batch(0.0, 2.5) == 2.5  # else the time-averaged sequences between tokens
    assert window_batch(0.0, 0.0) is None and window_batch(None, None) is None


def test_rates_span_the_window_not_just_the_last_scrape():
    history = [(0.0, {}), (5.0, {}), (10.0, {}), (15.0, {})]
    assert window_start(history, 20.0, 15.0)[0] == 5.0  # oldest within the window
    assert window_start(history, 20.0, None)[0] == 15.0  # no window: the previous scrape
    assert window_start(history, 20.0, 15.0 / 1.25 - 0.1)[0] == 10.0
    assert window_start(history[:1], 100.0, 15.0)[0] == 0.0  # nothing recent: the latest there is
    assert window_start([], 1.0, 15.0) is None


def test_parse_exposition_reads_contract_metrics():
    metrics = WorkerMetrics("decode")
    metrics.advance(2.0, Traffic(arrival_rate=4, output_len=10, step_s=0.05), 1, 1)
    parsed = parse_exposition(metrics.render().decode())
    assert parsed["decode"].role_flag == 1 and parsed["prefill"].role_flag == 0
    assert parsed["decode"].counters["requests"] == 8
    assert parsed["decode"].counters["itl_count"] == 80
    assert parsed["decode"].counters["itl_sum"] == pytest.approx(4.0)
    assert parsed["decode"].gauges["running"] == 8.0


def test_counter_rates_between_scrapes():
    assert counter_rate(10.0, 30.0, 2.0) == 10.0
    assert counter_rate(50.0, 5.0, 1.0) == 5.0  # restarted: counted from zero
    assert counter_rate(None, 5.0, 1.0) is None
    first = parse_exposition(WorkerMetrics("prefill").render().decode())
    assert series_rates("w", None, first, 0.0)[0].prompt_tokens is None


@pytest.mark.asyncio
async def test_scrape_source_over_http():
    traffic = Traffic(arrival_rate=6, input_len=1000, output_len=10, hit_rate=0.5,
                      prefill_supply=20_000)
    workers = [FakeWorker("prefill"), FakeWorker("decode"), FakeWorker("decode")]
    for worker in workers:
        await worker.start()
    clock = [0.0]
    source = ScrapeSource([w.url for w in workers], clock=lambda: clock[0])
    try:
        first = await source.snapshot()
        assert first.arrival_rate is None and first.pools["decode"] == 2
        for worker in workers:
            worker.metrics.advance(5.0, traffic, 1, 2)
        clock[0] = 5.0
        snap = await source.snapshot()
    finally:
        await source.aclose()
        for worker in workers:
            await worker.stop()
    assert snap.arrival_rate == pytest.approx(6.0)
    assert snap.input_len == pytest.approx(1000.0)
    assert snap.output_len == pytest.approx(10.0)
    assert snap.hit_rate == pytest.approx(0.5)
    assert snap.prefill_supply == pytest.approx(20_000.0)
    assert snap.decode_running == 8.0



@pytest.mark.asyncio
async def test_a_worker_that_does_not_answer_is_counted_not_read_as_idle():
    async with running_workers("prefill", "decode") as workers:
        source = ScrapeSource([w.url for w in workers], timeout=2.0)
        try:
            assert (await source.snapshot()).unanswered == 0
            await workers[1].stop()
            partial = await source.snapshot()
        finally:
            await source.aclose()
    assert partial.unanswered == 1 and partial.pools["prefill"] == 1
    observation = ObservationBuilder().build(partial, PoolState(1, 1), 0.0)
    assert observation.unreachable_workers == 1  # so the policy holds instead of sizing a lull


@pytest.mark.asyncio
async def test_scrape_source_rates_over_a_window():
    workers = [FakeWorker("prefill"), FakeWorker("decode")]
    for worker in workers:
        await worker.start()
    clock = [0.0]
    source = ScrapeSource([w.url for w in workers], clock=lambda: clock[0], window_s=10.0)
    busy, idle = Traffic(arrival_rate=4, input_len=1000), Traffic(arrival_rate=0.0001, input_len=1000)
    found = []
    try:
        for traffic in (None, busy, idle, idle, idle):
            if traffic is not None:
                for worker in workers:
                    worker.metrics.advance(5.0, traffic, 1, 1)
                clock[0] += 5.0
            found.append(await source.snapshot())
    finally:
        await source.aclose()
        for worker in workers:
            await worker.stop()
    rates = [s.arrival_rate for s in found]
    assert rates[0] is None
    assert rates[1] == pytest.approx(4.0)  # one scrape back: all there is
    assert rates[2] == pytest.approx(2.0)  # the busy 5 s and the idle 5 s, over 10 s
    assert rates[3] == pytest.approx(0.0, abs=0.01) and rates[4] == pytest.approx(0.0, abs=0.01)


def test_prometheus_results_become_series():
    results = {
        "requests": [{"metric": {"instance": "a", "role": "decode"}, "value": [0, "2.5"]}],
        "running": [{"metric": {"instance": "a", "role": "decode"}, "value": [0, "NaN"]}],
        "role": [{"metric": {"instance": "a", "role": "decode"}, "value": [0, "1"]},
                 {"metric": {"instance": "a", "role": "prefill"}, "value": [0, "0"]},
                 {"metric": {"role": "decode"}, "value": [0, "1"]}],  # no worker label: ignored
    }
    series = {(s.worker, s.role): s for s in series_from_results(results)}
    assert set(series) == {("a", "decode"), ("a", "prefill")}
    assert series["a", "decode"].requests == 2.5 and series["a", "decode"].current
    assert series["a", "decode"].running is None
    assert not series["a", "prefill"].current
