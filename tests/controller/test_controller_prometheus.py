"""PrometheusSource against a real Prometheus scraping real prometheus_client exporters."""

from __future__ import annotations

import asyncio
import time

import pytest
from fleet_harness import Traffic, WorkerMetrics
from prometheus_client import start_http_server
from prometheus_fixture import free_port, running_prometheus

from baton.autoscaler.metrics_prometheus import PrometheusSource

TRAFFIC = Traffic(arrival_rate=6, input_len=1000, output_len=10, hit_rate=0.5,
                  prefill_supply=20_000, step_s=0.04, batch=5, kv_usage=0.25)


@pytest.mark.asyncio
async def test_prometheus_source_measures_the_load(tmp_path):
    workers = [WorkerMetrics("prefill"), WorkerMetrics("decode"), WorkerMetrics("decode")]
    servers, targets = [], []
    for worker in workers:
        port = free_port()
        servers.append(start_http_server(port, addr="127.0.0.1", registry=worker.scraped))
        targets.append(f"127.0.0.1:{port}")
    try:
        with running_prometheus(targets, tmp_path) as prometheus:
            await asyncio.to_thread(prometheus.wait_for_targets, len(targets))
            started = last = time.monotonic()
            while time.monotonic() - started < 6.0:  # several 1 s scrapes of a steady load
                await asyncio.sleep(0.05)
                now = time.monotonic()
                for worker in workers:
                    worker.advance(now - last, TRAFFIC, 1, 2)
                last = now
            source = PrometheusSource(prometheus.url, window="4s")
            snap = await source.snapshot()
            await source.aclose()
    finally:
        for server, thread in servers:
            server.shutdown()
            thread.join(5)

    assert snap.pools == {"prefill": 1, "decode": 2, "both": 0}
    assert snap.arrival_rate == pytest.approx(6, rel=0.2)
    assert snap.input_len == pytest.approx(1000, rel=0.1)  # ratios of rates: steadier
    assert snap.output_len == pytest.approx(10, rel=0.1)
    assert snap.hit_rate == pytest.approx(0.5, abs=0.01)
    assert snap.prefill_supply == pytest.approx(20_000, rel=0.01)
    assert snap.decode_running == 5 and snap.decode_kv_usage == 0.25
    assert len(snap.step_samples) == 2
    assert all(s.step_s == pytest.approx(0.04) and s.batch == 5 for s in snap.step_samples)


@pytest.mark.asyncio
async def test_prometheus_without_data_is_unknown(tmp_path):
    with running_prometheus([], tmp_path) as prometheus:
        source = PrometheusSource(prometheus.url, window="5s")
        snap = await source.snapshot()
    assert snap.arrival_rate is None and snap.input_len is None and snap.prefill_supply is None
    assert snap.pools == {"prefill": 0, "decode": 0, "both": 0}
