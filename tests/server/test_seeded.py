"""A seeded request gives the offline engine's tokens on every path between real workers:
remote prefill over TCP (16-token blocks → 32) and shared memory (16 → 16), migration
mid-stream after a remote prefill, and the router's re-issue (official `openai` client)
after a worker gives the request up mid-stream. The local path through `baton up` is in
tests/local/test_local_stack.py."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from tests.router.router_harness import running_router
from tests.server.workers import TOKEN, handoff, new_id

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("blocks_restored")]
PROMPTS = (0, 5, 7)  # 4, 17 and 51 tokens: the last spans two of decode-tcp's 32-token blocks


def seeded(i: int, max_tokens: int = 20) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95, "seed": 100 + i,
            "ignore_eos": True}


@pytest.fixture(scope="module")
def offline():
    from baton.engine.engine import Engine

    return Engine(dtype="float32", threads=1, num_kv_blocks=256)


def offline_tokens(engine, ids: list[int], params: dict) -> list[int]:
    from baton.engine.sampling import SamplingParams

    return engine.generate([ids], SamplingParams(**params))[0].token_ids


@pytest.mark.parametrize("decoder", ["decode-tcp", "decode-shm"])
def test_seeded_remote_prefill_equals_the_offline_engine(cluster, prompt_ids, offline, decoder):
    for i in PROMPTS:
        expected = offline_tokens(offline, prompt_ids[i], seeded(i))
        r = asyncio.run(handoff(cluster["prefill"], cluster[decoder], prompt_ids[i], seeded(i)))
        assert not r["errors"], r["errors"]
        assert r["token_ids"] == expected, f"prompt {i} ({len(prompt_ids[i])} tokens) diverged on {decoder}"


def test_seeded_tokens_survive_a_migration_after_a_remote_prefill(cluster, prompt_ids, offline):
    """prefill (16) → decode-tcp (32) → after 6 tokens, migrated to decode-shm (16)."""
    i, rid, outcome = 6, new_id("seedmig"), {}
    expected = offline_tokens(offline, prompt_ids[i], seeded(i, 32))
    source, target = cluster["decode-tcp"], cluster["decode-shm"]

    async def on_event(_event, so_far):
        if "reply" not in outcome and len(so_far["token_ids"]) >= 6:
            outcome["reply"] = None  # once
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
                outcome["reply"] = await c.post(source.url + "/internal/migrate",
                                                json={"request_id": rid, "target": target.url})

    r = asyncio.run(handoff(cluster["prefill"], source, prompt_ids[i], seeded(i, 32), rid=rid,
                            on_event=on_event))
    assert outcome["reply"].status_code == 200, outcome["reply"].text
    assert not r["errors"], r["errors"]
    assert r["token_ids"] == expected


@pytest.mark.parametrize("threshold", [0, 10_000], ids=["remote", "local"])
def test_seeded_request_reissued_after_a_lost_worker_equals_offline(cluster, prompt_ids, offline, threshold):
    """The decode worker gives the request up after a few tokens; the router re-issues it
    with the tokens so far as prompt, and the rest is still the offline engine's."""
    from baton.router.tokenizing import load_model_info

    i = 7
    expected = offline.tokenizer.decode(offline_tokens(offline, prompt_ids[i], seeded(i, 32)))
    decoders = [cluster["decode-tcp"], cluster["decode-shm"]]

    async def scenario():
        urls = [w.url for w in (*decoders, cluster["prefill"])]
        async with running_router(load_model_info(None, served_name="smollm2"), urls,
                                  internal_token=TOKEN, disagg_threshold=threshold) as url:
            api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            stream = await api.completions.create(
                model="smollm2", prompt=prompt_ids[i], max_tokens=32, temperature=0.8, top_p=0.95,
                seed=100 + i, stream=True, extra_body={"ignore_eos": True})
            text, chunks = "", 0
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        text += chunk.choices[0].text
                        chunks += 1
                        if chunks == 4:  # the worker holding it gives it up, as one shutting down
                            for w in decoders:
                                await c.post(f"{w.url}/internal/abort/{chunk.id}")
                metrics = (await c.get(f"{url}/metrics")).text
            return text, metrics

    text, metrics = asyncio.run(scenario())
    reissued = re.search(r'baton_router_retries_total\{reason="worker_lost"\} (\S+)', metrics)
    assert reissued and float(reissued.group(1)) == 1.0, "the request was not re-issued"
    assert text == expected
