"""The fluid fleet: queues build when a pool is short, conversions cost time, KV bounds admission."""

import json

import numpy as np
import pytest

from baton.sim.fleet import DECODE, PREFILL, Fleet, FleetConfig
from baton.sim.hardware import GPUS, MODELS, CalibratedPerf, RooflinePerf, worker_perf
from baton.sim.workload import CHAT, DOCUMENTS, DriftingDay, make_ticks

PERF = worker_perf("llama-3-8b", "h100")
CONFIG = FleetConfig(PERF, (DOCUMENTS, CHAT), dt=2.0, reshard_s=30.0)


def _run(fleet, arrivals, ticks):
    return [fleet.step(np.asarray(arrivals, dtype=float)) for _ in range(ticks)]


def test_roofline_numbers_are_plausible():
    assert MODELS["llama-3-70b"].kv_per_token == 327_680
    perf = RooflinePerf(MODELS["llama-3-8b"], GPUS["h100"])
    assert 15_000 < perf.prefill_tokens_per_s(4000) < 40_000
    assert 0.005 < float(perf.decode_step_s(1, 1000)) < 0.02  # weights read once
    assert float(perf.decode_step_s(256, 2000)) > float(perf.decode_step_s(16, 2000))
    assert perf.kv_capacity_tokens == pytest.approx((80e9 * 0.9 - 8.03e9 * 2) / 131_072)
    with pytest.raises(ValueError):
        RooflinePerf(MODELS["llama-3-70b"], GPUS["a100"], gpus=1)


def test_calibrated_perf_from_bench_json(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({
        "prefill_tokens_per_s": 900.0, "prefill_prompt_len": 512,
        "decode_step": {"intercept_s": 0.02, "per_seq_s": 0.001, "per_seq_token_s": 1e-6},
        "kv_capacity_tokens": 50_000, "kv_bytes_per_token": 23_040, "n_layers": 30, "link_bytes_per_s": 1e9,
    }))
    perf = worker_perf("ignored", "ignored", calibration=str(path))
    assert isinstance(perf, CalibratedPerf)
    assert perf.prefill_tokens_per_s(512) == pytest.approx(900.0)
    assert perf.decode_step_s(10, 1000) == pytest.approx(0.02 + 0.01 + 0.01)
    assert perf.exposed_transfer_s(1000) == pytest.approx(1000 * 23_040 / 1e9 / 30)


def test_short_prefill_pool_builds_a_backlog_and_enough_does_not():
    per_worker = 1 / CONFIG.service_s[0]  # documents requests one prefill worker finishes per second
    arrivals = [3 * per_worker * CONFIG.dt, 0.0]
    short = _run(Fleet(CONFIG, [2], [14]), arrivals, 50)
    ample = _run(Fleet(CONFIG, [6], [10]), arrivals, 50)
    assert short[-1].backlog_wait_s[0] > short[10].backlog_wait_s[0] > 0
    assert ample[-1].backlog_wait_s[0] == 0.0
    assert ample[-1].prefill_rho[0] == pytest.approx(0.5, rel=0.01)


def test_kv_capacity_bounds_the_decode_batch():
    fleet = Fleet(CONFIG, [8], [1])
    records = _run(fleet, [0.0, 200.0 * CONFIG.dt], 200)
    assert records[-1].kv_usage[0] <= 1.0 + 1e-9
    assert records[-1].admission_wait_s[0] > 0
    assert fleet.running[0].sum() <= PERF.kv_capacity_tokens / (CHAT.mean_input + CHAT.mean_output / 2) + 1e-6


def test_conversion_takes_the_worker_out_for_its_downtime():
    fleet = Fleet(CONFIG, [4], [4])
    _run(fleet, [5.0, 5.0], 10)
    downtime = fleet.start_conversion(0, DECODE)
    assert downtime >= CONFIG.reshard_s
    assert (fleet.prefill_workers[0], fleet.decode_workers[0], fleet.in_flight(0)) == (4, 3, 1)
    ticks = 0
    while fleet.in_flight(0):
        _run(fleet, [5.0, 5.0], 1)
        ticks += 1
    assert downtime <= ticks * CONFIG.dt <= downtime + 2 * CONFIG.dt
    assert (fleet.prefill_workers[0], fleet.decode_workers[0]) == (5, 3)
    fleet.start_conversion(0, PREFILL)
    assert fleet.prefill_workers[0] == 4 and fleet.conversions[0].to_role == DECODE


def test_little_law_holds_in_steady_state():
    fleet = Fleet(CONFIG, [4], [8])
    rate = 20.0
    records = _run(fleet, [0.0, rate * CONFIG.dt], 600)
    step = records[-1].step_s[0]
    expected = rate * CHAT.mean_output * step  # sessions in flight during a tick
    assert records[-1].batch[0] * 8 == pytest.approx(expected, rel=0.05)


def test_drifting_day_goes_from_documents_to_chat_and_back():
    day = DriftingDay(hours=6, peak_rate=100.0)
    ticks = make_ticks(day, 2.0, seed=3)
    share = ticks.class_share[:, 1]
    assert share[0] == pytest.approx(0.1) and share[len(share) // 2] == pytest.approx(0.9, abs=1e-3)
    assert share[-1] < 0.11
    assert ticks.arrivals.sum() / day.duration_s == pytest.approx(ticks.rate.mean(), rel=0.01)
    again = make_ticks(day, 2.0, seed=3)
    assert np.array_equal(ticks.arrivals, again.arrivals)
