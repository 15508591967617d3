"""The router keeps its recent placement decisions and what made each (`/router/placements`):
the log itself (pure), then the real router against loopback fake workers."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest
from router_harness import running_router

from baton.router.placements import Placement, PlacementLog, placement_summary
from baton.router.threshold import DEFAULT_STALL_WEIGHT, ThresholdEstimator


def placement(path: str, threshold: float, tokens: int = 256, at: float = 0.0) -> Placement:
    return Placement(at, f"r{at}", tokens, tokens, path, threshold, "d", "p",
                     {"decoding": 3, "held_prompts": 1.25, "local_s_per_token": None}, {"mode": "auto", "o_fixed_s": 0.05})


def test_the_log_keeps_the_last_decisions_and_counts_them_all():
    log = PlacementLog(kept=3)
    for i in range(5):
        log.record(placement("local", 100.0 + i, at=float(i)))
    assert log.total == 5
    assert [p.at for p in log.recent()] == [2.0, 3.0, 4.0]  # oldest first
    assert [p.at for p in log.recent(2)] == [3.0, 4.0]
    assert [p.at for p in log.recent(10)] == [2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="at least 1"):
        PlacementLog(kept=0)


def test_a_placement_as_json_has_no_infinity_and_keeps_its_terms():
    as_json = placement("local", math.inf).as_json()
    assert as_json["threshold_tokens"] is None  # every prompt stays home
    assert as_json["terms"] == {"decoding": 3, "held_prompts": 1.25, "local_s_per_token": None}
    assert as_json["estimates"] == {"mode": "auto", "o_fixed_s": 0.05} and as_json["fallback"] is False
    assert placement("remote", 123.456789).as_json()["threshold_tokens"] == pytest.approx(123.457)


def test_the_summary_counts_paths_and_infinite_thresholds():
    alone = Placement(0.0, "r", 256, 256, "local", 512.0, "d", None)  # no prefill worker: its threshold says nothing
    fell_back = Placement(0.0, "r-local", 256, 256, "local", 100.0, "d", "p", fallback=True)  # after a remote try
    decisions = [placement("local", math.inf), placement("local", 400.0), placement("remote", 100.0),
                 placement("remote", 200.0), alone, fell_back]
    assert placement_summary(decisions) == {"placements": 5, "local": 3, "remote": 2, "fell_back_local": 1,
                                            "without_prefill_worker": 1, "infinite_thresholds": 1,
                                            "threshold_tokens": {"min": 100.0, "median": 200.0, "max": 400.0}}
    assert placement_summary([alone]) == {"placements": 1, "local": 1, "remote": 0, "fell_back_local": 0,
                                          "without_prefill_worker": 1, "infinite_thresholds": 0}
    assert placement_summary([]) == {"placements": 0, "local": 0, "remote": 0, "fell_back_local": 0,
                                     "without_prefill_worker": 0, "infinite_thresholds": 0}


def test_an_infinite_threshold_is_null_in_the_routers_state():
    # a link so slow that sending a token costs more than computing it: every prompt stays home
    estimator = ThresholdEstimator()
    estimator.observe_prefill_rate(0.001)
    estimator.observe_transfer(num_bytes=1e6, seconds=1.0, tokens=10)  # 0.1 s a token on the wire
    estimator.observe_remote(10, ttft_s=1.5, worker_s=0.01)
    assert estimator.threshold() == math.inf
    explained = estimator.explain()
    assert explained["threshold_tokens"] is None and explained["o_fixed_s"] == pytest.approx(0.49)
    json.dumps(explained, allow_nan=False)  # as the router's JSON answers are written
    assert "threshold_tokens" not in estimator.explain(with_threshold=False)


@pytest.mark.asyncio
async def test_the_router_serves_each_prompts_path_and_the_threshold_it_met(fake_workers, model_info):
    decode, prefill = await fake_workers("decode"), await fake_workers("prefill")
    async with running_router(model_info, [decode.url, prefill.url], api_key="k") as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=20)
        await api.completions.create(model="smollm2", prompt=[7] * 100, max_tokens=2)  # below the fallback 512
        await api.completions.create(model="smollm2", prompt=[8] * 600, max_tokens=2)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer k"}) as http:
            answer = (await http.get("/router/placements")).json()
            last = (await http.get("/router/placements", params={"limit": 1})).json()
            bad = [await http.get("/router/placements", params={"limit": value}) for value in ("0", "-1", "a")]
            unkeyed = await httpx.AsyncClient(base_url=url).get("/router/placements")
    assert answer["total"] == 2
    assert answer["summary"]["local"] == 1 and answer["summary"]["remote"] == 1
    short, long = answer["placements"]
    assert (short["path"], short["prompt_tokens"], long["path"], long["prompt_tokens"]) == ("local", 100, "remote", 600)
    assert short["decode_worker"] == decode.url and short["prefill_worker"] == prefill.url
    assert short["uncached_tokens"] <= 100 < short["threshold_tokens"] and long["threshold_tokens"] <= 600
    # the load terms the threshold was worked out from, and the estimates of the moment
    assert set(short["terms"]) == {"decoding", "queued_tokens", "held_prompts", "local_s_per_token",
                                   "local_queued_tokens", "stall_weight", "local_wait_factor"}
    assert short["terms"]["local_wait_factor"] == 1.0  # nothing decoding there
    # the prefill worker names no chunk: both prompts at the router's weight
    assert short["terms"]["stall_weight"] == long["terms"]["stall_weight"] == DEFAULT_STALL_WEIGHT
    assert short["estimates"]["stall_weight"] == DEFAULT_STALL_WEIGHT
    assert short["estimates"]["mode"] == "auto" and "o_fixed_s" in short["estimates"]
    assert last["placements"] == [long] and last["total"] == 2
    for response in bad:
        assert response.status_code == 400 and response.json()["error"]["param"] == "limit"
    assert unkeyed.status_code == 401


@pytest.mark.asyncio
async def test_a_prompt_headed_to_decodes_past_their_objective_weighs_their_stall_in_full(fake_workers, model_info):
    """A decode worker whose state says its decodes alone outrun their TPOT objective (a slow
    CPU): its prompts are placed at stall weight 1, whatever the router's own."""
    decode, prefill = await fake_workers("decode"), await fake_workers("prefill")
    async with running_router(model_info, [decode.url, prefill.url]) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
        await api.completions.create(model="smollm2", prompt=[7] * 100, max_tokens=2)
        decode.decodes_past_objective = True
        await asyncio.sleep(0.3)  # the router's next poll of the decode worker's state
        await api.completions.create(model="smollm2", prompt=[8] * 100, max_tokens=2)
        async with httpx.AsyncClient(base_url=url) as http:
            answer = (await http.get("/router/placements")).json()
    before, after = answer["placements"]
    assert before["terms"]["stall_weight"] == DEFAULT_STALL_WEIGHT and after["terms"]["stall_weight"] == 1.0


@pytest.mark.asyncio
async def test_a_prompt_whose_remote_path_fails_is_recorded_again_where_it_went(fake_workers, model_info):
    decode, prefill = await fake_workers("decode"), await fake_workers("prefill")
    prefill.fail_prefills = 5  # every try fails: the prompt falls back to its decode worker
    async with running_router(model_info, [decode.url, prefill.url], disagg_threshold=0) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
        await api.completions.create(model="smollm2", prompt=[9] * 100, max_tokens=2)
        async with httpx.AsyncClient(base_url=url) as http:
            answer = (await http.get("/router/placements")).json()
    decided, fell_back = answer["placements"]
    assert (decided["path"], decided["fallback"]) == ("remote", False)
    assert (fell_back["path"], fell_back["fallback"]) == ("local", True)
    assert fell_back["request_id"] == decided["request_id"] + "-local" and fell_back["decode_worker"] == decode.url
    assert answer["summary"]["remote"] == 1 and answer["summary"]["fell_back_local"] == 1
    assert len(decode.paths("generate")) == 1


@pytest.mark.asyncio
async def test_a_fixed_threshold_has_no_load_terms(fake_workers, model_info):
    decode, prefill = await fake_workers("decode"), await fake_workers("prefill")
    async with running_router(model_info, [decode.url, prefill.url], disagg_threshold=50.0) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
        await api.completions.create(model="smollm2", prompt=[9] * 100, max_tokens=2)
        async with httpx.AsyncClient(base_url=url) as http:
            (only,) = (await http.get("/router/placements")).json()["placements"]
    assert only["path"] == "remote" and only["threshold_tokens"] == 50.0 and only["terms"] == {}
    assert only["estimates"]["mode"] == "fixed"
