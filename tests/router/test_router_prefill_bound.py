"""Placement when the prefill pool is the bottleneck: a decode worker whose own requests
mostly wait on the prefill worker takes prompts home (pure rules, then the real router
against loopback fake workers)."""

from __future__ import annotations

import asyncio
import math

import openai
import pytest
from router_harness import running_router
from test_router_fake_workers import wait_for_calls

from baton.router.policy import (
    WorkerSnapshot,
    choose_path,
    decodes_stalled_by_local,
    prefill_queue_ahead,
    prompts_done_within,
    prompts_held_up,
)
from baton.router.pool import Membership, WorkerPool
from baton.router.threshold import threshold_tokens


def test_prompts_done_within_takes_the_fewest_tokens_first():
    assert prompts_done_within([], 1.0, 0.001) == 0
    assert prompts_done_within([2000, 256, 256], 0.6, 0.001) == 2  # the two short ones, 0.512 s
    assert prompts_done_within([2000, 256, 256], 0.5, 0.001) == 1
    assert prompts_done_within([256], 0.25, 0.001) == 0  # not quite: still queued at its end
    assert prompts_done_within([256], 1.0, 0.0) == 0  # no rate known: none counted


def test_reservations_still_queued_on_the_prefill_worker_are_not_stalled_by_a_local_prefill():
    # three streams decoding, five requests reserved here waiting on a prefill worker that
    # takes 0.29 s a 256-token prompt (a Zen 4 core); a local prefill of 256 tokens at 1.2 ms
    # a token (0.31 s) stalls the three and the one reservation whose prompt ends within it
    decode = WorkerSnapshot(url="d", role="decode", running=3, reserved=5, awaiting_remote=5)
    queue = [256] * 5
    assert decodes_stalled_by_local(decode, queue, 256, 0.0012, 0.00114) == 4
    assert decodes_stalled_by_local(decode, queue, 512, 0.0012, 0.00114) == 5
    assert decodes_stalled_by_local(decode, queue, 4000, 0.0012, 0.00114) == 8  # all of them arrive in time
    # a prompt longer than the prefill worker's chunk counts every request there
    assert decodes_stalled_by_local(decode, queue, 600, 0.0012, 0.00114, chunk_size=512) == 8
    # reservations another router made are counted as streams: this one knows nothing of them
    assert decodes_stalled_by_local(WorkerSnapshot(url="d", role="decode", running=3, reserved=5),
                                    queue, 256, 0.0012, 0.00114) == 8
    # never more awaiting than at work there
    assert decodes_stalled_by_local(WorkerSnapshot(url="d", role="decode", inflight=2, awaiting_remote=4),
                                    [], 256, 0.001, 0.001) == 0


def test_a_remote_prompt_counts_the_prompts_it_holds_up_on_the_prefill_worker():
    measured = dict(o_fixed_s=0.010, prefill_s_per_token=0.001, kv_bytes_per_token=500_000, link_bytes_per_s=1e9)
    # nothing queued there: as before
    assert threshold_tokens(**measured, decoding=3) == threshold_tokens(**measured, decoding=3, held_prompts=0)
    # two prompts there it would hold up, 1 ms a token each: 10 ms / (4 - 0.5 - 2) ms
    assert threshold_tokens(**measured, decoding=3, held_prompts=2) == pytest.approx(0.010 / 0.0015)
    # holding them up costs more than the streams here lose: home, whatever its length
    assert threshold_tokens(**measured, decoding=1, held_prompts=2) == math.inf


def test_a_remote_prompt_holds_up_the_prompts_that_arrive_while_it_waits():
    # 256-token prompts sent at 3 a second: one that waits 1.5 s holds up 4.5 of them
    now = 100.0
    sends = [(now - i / 3, 256) for i in range(30)]  # the last 10 s
    assert prompts_held_up(sends, now, 256, wait_s=1.5) == pytest.approx(4.5)
    # shared by two prefill workers
    assert prompts_held_up(sends, now, 256, wait_s=1.5, prefill_workers=2) == pytest.approx(2.25)
    # sends older than the window do not count
    assert prompts_held_up([(now - 20, 256)] * 10, now, 256, wait_s=1.5) == 0.0
    # the worker takes the fewest tokens first: only prompts of at least its tokens wait for it
    mixed = [(now - 1, 64)] * 20 + [(now - 1, 2000)] * 3
    assert prompts_held_up(mixed, now, 64, wait_s=1.0) == pytest.approx(2.3)
    assert prompts_held_up(mixed, now, 256, wait_s=1.0, chunk_size=512) == pytest.approx(0.3)
    # longer than the prefill worker's chunk: none (its local cost is not priced past a chunk)
    assert prompts_held_up(mixed, now, 2000, wait_s=5.0, chunk_size=512) == 0.0
    # a prompt that would not wait: none
    assert prompts_held_up(sends, now, 256, wait_s=0.0) == 0.0


def test_a_local_prompt_waits_for_the_prompts_queued_where_it_decodes():
    measured = dict(o_fixed_s=0.010, prefill_s_per_token=0.001, kv_bytes_per_token=500_000, link_bytes_per_s=1e9)
    # 2 s of prompts queued at the prefill worker, 1 s at the decode worker: 1.01 s saved
    assert threshold_tokens(**measured, decoding=3, queued_tokens=2000,
                            local_queued_tokens=1000) == pytest.approx(1.010 / 0.0035)
    # the local queue the longer wait: away, whatever its length
    assert threshold_tokens(**measured, decoding=3, queued_tokens=100, local_queued_tokens=1000) == 0.0
    # even where a token costs more sent than computed here
    assert threshold_tokens(**measured, decoding=1, held_prompts=2, local_queued_tokens=1000) == 0.0


def test_a_long_prompt_is_not_kept_home_for_the_prompts_arriving_at_the_prefill_worker():
    # a Zen 4 pair in the interference benchmark: eight streams decoding, the prefill worker
    # busy with 2,000-token prompts in 512-token chunks, one every 3 s, and short ones; a
    # decode worker whose chunks cost it 0.4 ms a token beside its decodes
    measured = dict(o_fixed_s=0.05, prefill_s_per_token=0.0011, kv_bytes_per_token=23040, link_bytes_per_s=1e9,
                    local_s_per_token=0.0004)
    queue = [2000, 2000, 64]
    decode = WorkerSnapshot(url="d", role="decode", running=8)
    stalled = decodes_stalled_by_local(decode, queue, 2000, 0.0004, 0.0011, chunk_size=512)
    ahead = prefill_queue_ahead(queue, 2000, 512)
    wait = 0.05 + (ahead + 2000) * 0.0011
    sends = [(10.0 - 3 * i, 2000) for i in range(4)]
    held = prompts_held_up(sends, 10.0, 2000, wait, chunk_size=512)
    assert stalled == 8 and held == 0.0
    assert choose_path(2000, threshold_tokens(**measured, decoding=stalled, queued_tokens=ahead, held_prompts=held),
                       True) == "remote"
    # counting the long ones arriving while it waits (2.2 of them) would have kept it home
    unchunked = prompts_held_up(sends, 10.0, 2000, wait)
    assert unchunked > 2
    assert choose_path(2000, threshold_tokens(**measured, decoding=stalled, queued_tokens=ahead,
                                              held_prompts=unchunked), True) == "local"


def test_a_prefill_bound_pair_sends_some_prompts_home_and_an_idle_one_none():
    # a Zen 4 pair under vLLM's client (bench/serving.py): 0.29 s a 256-token prompt at the
    # prefill worker (1.14 ms a token), 1.2 ms a token in the decode worker's chunks, 256-token
    # prompts sent there at 3 a second
    measured = dict(o_fixed_s=0.05, prefill_s_per_token=0.00114, kv_bytes_per_token=23040, link_bytes_per_s=1e9,
                    local_s_per_token=0.0012)
    decode = WorkerSnapshot(url="d", role="decode", running=3, reserved=4, awaiting_remote=4)
    queue = [256] * 4
    sends = [(100.0 - i / 3, 256) for i in range(30)]
    stalled = decodes_stalled_by_local(decode, queue, 256, 0.0012, 0.00114)
    ahead = prefill_queue_ahead(queue, 256)
    held = prompts_held_up(sends, 100.0, 256, 0.05 + (ahead + 256) * 0.00114)
    assert stalled == 4 and held == pytest.approx(4.5, abs=0.1)
    busy = threshold_tokens(**measured, decoding=stalled, queued_tokens=ahead, held_prompts=held)
    assert choose_path(256, busy, True) == "local"
    # with as many prompts already queued to prefill at the decode worker: away
    assert choose_path(256, threshold_tokens(**measured, decoding=stalled, queued_tokens=ahead, held_prompts=held,
                                             local_queued_tokens=1024), True) == "remote"
    # counted as before (every reservation a stream, no prompt held up), it went away
    assert choose_path(256, threshold_tokens(**measured, decoding=7, queued_tokens=ahead), True) == "remote"
    # the prefill worker idle: away
    idle = WorkerSnapshot(url="d", role="decode", running=3)
    assert choose_path(256, threshold_tokens(**measured, decoding=decodes_stalled_by_local(idle, [], 256, 0.0012,
                                                                                          0.00114)),
                       True) == "remote"


def test_the_pool_counts_reservations_whose_prompts_prefill_elsewhere():
    pool = WorkerPool(client=None)
    pool.set_members([Membership("d", "decode")])
    pool.begin("d")
    pool.begin_remote_prefill("d")
    assert pool.snapshots()[0].awaiting_remote == 1
    pool.end_remote_prefill("d")
    pool.end_remote_prefill("d")  # ended twice: nothing below zero
    assert pool.snapshots()[0].awaiting_remote == 0 and pool.snapshots()[0].inflight == 1


@pytest.mark.asyncio
async def test_a_prompt_goes_home_while_the_decode_workers_requests_wait_on_the_prefill_worker(
        fake_workers, model_info):
    """Three long prompts wait on a slow prefill worker, reserved on a decode worker that runs
    nothing yet: a 300-token prompt prefills where it decodes rather than hold the three up
    (counting the three as streams it would stall, and none it would hold up, sent it away).
    With every second alike (stall weight 1); at the default weight its own first token
    counts for more than the time the three would lose, and it goes ahead of them there."""
    decode, prefill = await fake_workers("decode"), await fake_workers("prefill")
    prefill.prefill_seconds_per_token = 0.002
    decode.prefill_seconds_per_token = 0.004  # its chunks beside decodes: dearer than the prefill worker's
    async with running_router(model_info, [decode.url, prefill.url], stall_weight=1.0) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
        # past the fallback threshold (512): remote, and the estimator learns the link and overhead
        await api.completions.create(model="smollm2", prompt=[7] * 600, max_tokens=2)
        await asyncio.sleep(0.2)  # polls: both workers' rates
        prefill.prefill_delay_s = 2.0
        waiting = []
        for i in range(3):
            waiting.append(asyncio.create_task(
                api.completions.create(model="smollm2", prompt=[100 + i] * 1000, max_tokens=2)))
            await wait_for_calls(prefill, "prefill", 2 + i)
        await api.completions.create(model="smollm2", prompt=[200] * 300, max_tokens=2)
        assert len(decode.paths("generate")) == 1, "the short prompt queued behind the long ones"
        await asyncio.gather(*waiting)
    assert len(prefill.paths("prefill")) == 4 and len(decode.paths("generate")) == 1


@pytest.mark.asyncio
async def test_a_cold_routers_first_burst_is_split_between_the_two_paths(fake_workers, model_info):
    """Nothing measured yet, eight prompts at once onto an idle pair: some prefill where they
    decode. The fallback threshold takes both sides' token costs as equal; counting the
    burst's reservations as streams the local prefills would stall (and those still being
    made as none awaiting the prefill worker) sent all but the first away, to be prefilled
    one after another (bench/serving.py's first wave on a Zen 4 pair: first tokens 0.4 to
    2.1 s, 0.3 s apart)."""
    decode, prefill = await fake_workers("decode"), await fake_workers("prefill")
    prefill.prefill_delay_s = 1.0  # every choice is made before any prefill ends
    decode.first_token_delay_s = 1.0  # and before any local prompt has its first token
    async with running_router(model_info, [decode.url, prefill.url]) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
        await asyncio.gather(*(api.completions.create(model="smollm2", prompt=[100 + i] * 300, max_tokens=2)
                               for i in range(8)))
    local, remote = len(decode.paths("generate")), len(prefill.paths("prefill"))
    assert local + remote == 8
    assert local >= 2 and remote >= 4, f"{local} prefilled locally, {remote} on the prefill worker"
