"""`baton worker --tensor-parallel-size N`: a real worker whose model is split over rank
processes answers like one that is not, and losing a rank fails its requests cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.engine.tiny_llama import write_tiny_llama
from tests.server.workers import generate, start_workers

PROMPTS = [[5, 17, 33, 200, 7], list(range(3, 90)), [9] * 30]
GREEDY = {"max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_workers(tmp_path_factory):
    model = str(write_tiny_llama(tmp_path_factory.mktemp("tiny-worker")))
    args = ["--model", model, "--num-kv-blocks", "64", "--chunk-size", "32"]
    workers = start_workers([("tp1", "both", args, None),
                             ("tp2", "both", [*args, "--tensor-parallel-size", "2"], None)])
    yield dict(zip(("tp1", "tp2"), workers))
    for w in workers:
        w.stop()


async def _generate_all(worker):
    return await asyncio.gather(*(generate(worker, ids, GREEDY) for ids in PROMPTS))


def test_tp2_worker_streams_the_same_tokens(tiny_workers):
    tp1, tp2 = tiny_workers["tp1"], tiny_workers["tp2"]
    state = tp2.state()
    assert state["tensor_parallel_size"] == 2 and len(state["rank_pids"]) == 1
    one, two = asyncio.run(_generate_all(tp1)), asyncio.run(_generate_all(tp2))
    for a, b in zip(one, two):
        assert not a["errors"] and not b["errors"]
        assert len(a["token_ids"]) == GREEDY["max_tokens"]
        assert a["token_ids"] == b["token_ids"]
    # a migrating sequence's KV would fill rank 0's heads only: refused until it fills every rank's
    reply = tp2.post("/internal/import", {"state": {"request_id": "r-tp"}})
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "tensor_parallel"


def test_a_role_switch_resizes_every_ranks_kv_pool(tiny_workers):
    tp1, tp2 = tiny_workers["tp1"], tiny_workers["tp2"]
    switched = tp2.post("/internal/role", {"role": "prefill"})
    assert switched.status_code == 200, switched.text
    assert tp2.state()["num_blocks"] == 16  # a prefill worker's pool is a quarter of a decode one's
    assert tp2.post("/internal/role", {"role": "both"}).status_code == 200
    assert tp2.state()["num_blocks"] == 64
    # every rank holds the whole pool again: blocks past the small pool's end work everywhere
    one, two = asyncio.run(_generate_all(tp1)), asyncio.run(_generate_all(tp2))
    assert [r["token_ids"] for r in one] == [r["token_ids"] for r in two]


def test_a_killed_rank_fails_requests_cleanly_and_the_worker_reports_it(tiny_workers):
    tp2 = tiny_workers["tp2"]
    [rank_pid] = tp2.state()["rank_pids"]
    os.kill(rank_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # an idle worker notices too: its health says so
    while tp2.get("/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tp2.get("/health").status_code == 503
    started = time.monotonic()
    result = asyncio.run(generate(tp2, PROMPTS[1], GREEDY))
    assert time.monotonic() - started < 30  # an error, not a wait for the collective timeout
    assert result["errors"] and "tensor-parallel rank 1" in str(result["errors"])
    health = tp2.get("/health")
    assert health.status_code == 503 and "rank 1" in health.json()["reason"]
    assert tp2.get("/ready").status_code == 503
    later = tp2.post("/internal/generate", {"request_id": "after", "prompt_token_ids": [5], "params": GREEDY})
    assert later.status_code == 503


def test_a_split_the_model_does_not_allow_stops_the_worker_with_both_numbers(tmp_path):
    model = write_tiny_llama(tmp_path / "six-heads", num_attention_heads=6, num_key_value_heads=3)
    done = subprocess.run(
        [sys.executable, "-m", "baton.cli", "worker", "--insecure-no-token", "--port", "0", "--kv-port", "0",
         "--model", str(model), "--num-kv-blocks", "16", "--tensor-parallel-size", "4"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode != 0
    assert "tensor-parallel size 4 does not divide the model's 6 query heads" in done.stdout + done.stderr
