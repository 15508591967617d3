"""The real router against loopback fake workers: both paths, every recovery, the errors.

The fake workers 'generate' a fixed script (see fake_worker.py), so the expected text is
known without a model.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from router_harness import running_router

from baton.engine.tokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.asyncio
TOKEN = "internal-secret"


@pytest.fixture
def expected(model_info, script) -> str:
    return model_info.tokenizer.decode(script)


def client(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)


async def collect(stream) -> tuple[str, str | None]:
    text, reason = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


async def test_local_path_stream_and_not(fake_workers, model_info, expected):
    decode = await fake_workers("decode", token=TOKEN)
    async with running_router(model_info, [decode.url], internal_token=TOKEN) as url:
        api = client(url)
        done = await api.completions.create(model="smollm2", prompt="Q:", max_tokens=100)
        assert done.choices[0].text == expected and done.choices[0].finish_reason == "stop"
        assert done.usage.completion_tokens == len(model_info.tokenizer.encode(expected)) + 1
        text, reason = await collect(await api.completions.create(
            model="smollm2", prompt="Q:", max_tokens=100, stream=True))
        assert (text, reason) == (expected, "stop")
        chat = await api.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3
        pieces = []
        async for c in await api.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "hi"}], stream=True,
                stream_options={"include_usage": True}):
            if c.choices:
                pieces.append(c.choices[0].delta.content or "")
            else:
                assert c.usage.prompt_tokens > 0
        assert "".join(pieces) == expected
    assert decode.auth_failures == 0 and len(decode.paths("generate")) == 4


async def test_remote_path_with_refused_reservation_and_failed_prefill(fake_workers, model_info, expected):
    d1, d2 = await fake_workers("decode"), await fake_workers("decode")
    p1, p2 = await fake_workers("prefill"), await fake_workers("prefill")
    d1.refuse_reserves = d2.refuse_reserves = 1  # first choice refuses, the other takes it
    p1.fail_prefills = p2.fail_prefills = 1  # first prefill fails: new reservation, other worker
    async with running_router(model_info, [d1.url, d2.url, p1.url, p2.url], disagg_threshold=0) as url:
        text, reason = await collect(await client(url).completions.create(
            model="smollm2", prompt="Q:", max_tokens=100, stream=True))
    assert (text, reason) == (expected, "stop")
    prefills = p1.paths("prefill") + p2.paths("prefill")
    assert len(prefills) == 2 and prefills[0] != prefills[1]  # the retry used a new request id
    assert len(d1.aborted + d2.aborted) >= 1  # the failed attempt's reservation was given back


async def test_a_burst_of_remote_prompts_reserves_evenly_across_decode_workers(fake_workers, model_info):
    """A reservation is a request the decode worker will run: counted from the moment it is
    made, not from when its stream opens after the prefill (by then the whole burst had
    reserved on the first worker)."""
    d1, d2, prefill = await fake_workers("decode"), await fake_workers("decode"), await fake_workers("prefill")
    prefill.prefill_delay_s = 1.0  # every choice is made before any of them ends
    async with running_router(model_info, [d1.url, d2.url, prefill.url], disagg_threshold=0) as url:
        api = client(url)
        await asyncio.gather(*(api.completions.create(model="smollm2", prompt=[100 + i] * 40, max_tokens=4)
                               for i in range(8)))
    assert len(prefill.paths("prefill")) == 8
    assert sorted([len(d1.paths("reserve")), len(d2.paths("reserve"))]) == [4, 4]


async def test_a_prompt_goes_to_the_colocated_worker_with_no_prompt_waiting_to_prefill(fake_workers, model_info):
    """Two colocated workers with one request each: the one still prefilling its prompt is
    passed over for the one already decoding (policy.rank_decode), whichever sorts first."""
    first, second = sorted([await fake_workers("both"), await fake_workers("both")], key=lambda x: x.url)
    first.first_token_delay_s = 2.0  # its request is still prefilling when the third comes
    second.token_delay_s = 0.05  # its request decodes for a second
    async with running_router(model_info, [first.url, second.url]) as url:
        api = client(url)
        prefilling = asyncio.create_task(api.completions.create(model="smollm2", prompt=[100] * 40, max_tokens=4))
        await wait_for_calls(first, "generate", 1)
        decoding = await api.completions.create(model="smollm2", prompt=[101] * 40, max_tokens=20, stream=True)
        await anext(aiter(decoding))  # its first token: nothing left to prefill there
        await api.completions.create(model="smollm2", prompt=[102] * 40, max_tokens=2)
        await collect(decoding)
        await prefilling
    assert (len(first.paths("generate")), len(second.paths("generate"))) == (1, 2)


async def wait_for_calls(worker, path: str, count: int, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(worker.paths(path)) < count:
        assert asyncio.get_running_loop().time() < deadline, f"{worker.url} got no {path} call in {timeout_s}s"
        await asyncio.sleep(0.01)


async def test_prefill_pool_down_falls_back_to_local(fake_workers, model_info, expected):
    decode, prefill = await fake_workers("decode"), await fake_workers("prefill")
    prefill.fail_prefills = 5
    async with running_router(model_info, [decode.url, prefill.url], disagg_threshold=0) as url:
        done = await client(url).completions.create(model="smollm2", prompt="Q:", max_tokens=100)
    assert done.choices[0].text == expected
    assert len(decode.paths("generate")) == 1


async def test_short_prompt_stays_local_long_goes_remote(fake_workers, model_info):
    decode, prefill = await fake_workers("decode"), await fake_workers("prefill")
    async with running_router(model_info, [decode.url, prefill.url], disagg_threshold=50) as url:
        api = client(url)
        await api.completions.create(model="smollm2", prompt="short", max_tokens=2)
        await api.completions.create(model="smollm2", prompt=[100] * 80, max_tokens=2)
        # same long prompt again: the decode worker already holds it, so it is short now
        await api.completions.create(model="smollm2", prompt=[100] * 80, max_tokens=2)
    assert len(decode.paths("generate")) == 2 and len(prefill.paths("prefill")) == 1


async def test_decode_worker_lost_mid_stream_resumes_elsewhere(fake_workers, model_info, expected):
    d1, d2 = await fake_workers("decode"), await fake_workers("decode")
    d1.die_after_tokens = d2.die_after_tokens = 3  # each dies once, after 3 tokens
    async with running_router(model_info, [d1.url, d2.url]) as url:
        text, reason = await collect(await client(url).completions.create(
            model="smollm2", prompt="Q:", max_tokens=100, stream=True))
    assert (text, reason) == (expected, "stop")
    resumed = d1.paths("generate") + d2.paths("generate")
    base = min(resumed, key=len)
    assert sorted(resumed) == [base, f"{base}-r1", f"{base}-r2"]


async def test_draining_worker_gets_no_new_work(fake_workers, model_info):
    d1, d2 = await fake_workers("decode"), await fake_workers("decode")
    d1.state = "draining"
    async with running_router(model_info, [d1.url, d2.url]) as url:
        for _ in range(3):
            await client(url).completions.create(model="smollm2", prompt="Q:", max_tokens=2)
    assert d1.paths("generate") == [] and len(d2.paths("generate")) == 3


async def test_bad_inputs_get_openai_errors(fake_workers, model_info):
    decode = await fake_workers("decode")
    async with running_router(model_info, [decode.url]) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        cases = [("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
                 ("/v1/chat/completions", {"model": "smollm2"}, 400),
                 ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400),
                 ("/v1/completions", {"prompt": "x", "max_tokens": 10**7}, 400),
                 ("/v1/completions", {"prompt": [5] * (model_info.max_model_len + 1)}, 400),
                 ("/v1/completions", {"prompt": "x", "n": 3}, 400)]
        for path, body, status in cases:
            r = await http.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            assert "message" in r.json()["error"]
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "smollm2"
        assert b"baton_router_requests_total" in (await http.get("/metrics")).content


async def test_api_key_and_admission_limit(fake_workers, model_info):
    decode = await fake_workers("decode", token_delay_s=0.05)
    async with running_router(model_info, [decode.url], api_key="k", max_running=1, max_waiting=0) as url:
        with pytest.raises(openai.AuthenticationError):
            await client(url, "wrong").completions.create(model="smollm2", prompt="x", max_tokens=2)
        api = client(url, "k")
        first = asyncio.create_task(api.completions.create(model="smollm2", prompt="x", max_tokens=5))
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer k"}) as http:
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert (await first).choices[0].finish_reason == "length"


async def test_a_full_pool_is_a_429_with_retry_after_not_a_lost_worker(fake_workers, model_info, expected):
    """A worker that queued a request past its deadline answers 429 (docs/contracts.md): the
    pool is full, the worker is not broken. The client gets 429 + Retry-After, streaming or
    not, nothing is re-issued, and the next request goes to the same worker at once."""
    decode = await fake_workers("decode")
    async with running_router(model_info, [decode.url]) as url, httpx.AsyncClient(base_url=url, timeout=20) as http:
        decode.queue_timeouts = 2
        for stream in (False, True):
            r = await http.post("/v1/completions", json={"prompt": "Q", "max_tokens": 5, "stream": stream})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
            assert r.json()["error"]["code"] == "overloaded" and "no room" in r.json()["error"]["message"]
        assert len(decode.paths("generate")) == 2  # neither was re-issued
        ok = await client(url).completions.create(model="smollm2", prompt="Q", max_tokens=100)
        assert ok.choices[0].text == expected and len(decode.paths("generate")) == 3


async def test_no_workers_is_a_clear_503(model_info):
    from baton.router.dispatch import Deadlines

    async with running_router(model_info, ["http://127.0.0.1:9"], wait_ready=False,
                              deadlines=Deadlines(no_worker_wait_s=0.3)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and "decode worker" in r.json()["error"]["message"]


async def test_fifty_concurrent_requests(fake_workers, model_info, expected):
    workers = [await fake_workers("decode"), await fake_workers("decode")]
    async with running_router(model_info, [w.url for w in workers]) as url:
        api = client(url)
        results = await asyncio.gather(*(api.completions.create(
            model="smollm2", prompt=f"Q{i}", max_tokens=100) for i in range(50)))
    assert all(r.choices[0].text == expected for r in results)
    assert min(len(w.paths("generate")) for w in workers) >= 10  # load was spread


async def test_client_leaving_mid_stream_aborts_on_the_worker(fake_workers, model_info):
    decode = await fake_workers("decode", token_delay_s=0.05)
    async with running_router(model_info, [decode.url]) as url, httpx.AsyncClient(base_url=url) as http:
        body = {"prompt": "Q:", "max_tokens": 100, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break  # the first chunk is in: leave
        for _ in range(100):
            if decode.aborted:
                break
            await asyncio.sleep(0.02)
        assert decode.aborted == decode.paths("generate")
        r = await http.get("/v1/completions")
        assert r.status_code == 405
        state = (await http.get("/router/state")).json()
        assert state["admission"]["running"] == 0


async def test_stream_opens_once_a_worker_takes_the_request(fake_workers, model_info):
    """The status, headers and a chat stream's role chunk come while the worker is still
    working on the first token (here it takes 0.5 s), not with it."""
    decode = await fake_workers("decode", token_delay_s=0.5)
    loop = asyncio.get_running_loop()
    async with running_router(model_info, [decode.url]) as url, httpx.AsyncClient(base_url=url, timeout=20) as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        started = loop.time()
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            opened = loop.time() - started
            seen = []  # (seconds, delta)
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen.append((loop.time() - started, json.loads(line[6:])["choices"][0]["delta"]))
    assert opened < 0.3
    assert seen[0][1] == {"role": "assistant", "content": ""} and seen[0][0] < 0.3
    assert seen[1][1]["content"] and seen[1][0] >= 0.45


async def test_every_token_gets_a_chunk_even_one_that_completes_no_character(fake_workers, model_info, script,
                                                                            expected):
    """The script ends in '—' and '✓', each split over tokens: a token that ends no
    character yet still streams, with empty text, so clients (and vLLM's benchmark, which
    times every chunk) see tokens as they are made; the text is unchanged."""
    detok = IncrementalDetokenizer(model_info.tokenizer, [])
    silent = sum(1 for token in script if not detok.add(token))
    assert silent >= 2  # the script does hold split characters
    decode = await fake_workers("decode")
    async with running_router(model_info, [decode.url]) as url:
        api = client(url)
        chunks = [c async for c in await api.completions.create(
            model="smollm2", prompt="Q:", max_tokens=100, stream=True)]
        chat = [c async for c in await api.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=100, stream=True)]
    # one chunk per script token, then the hidden EOS's chunk with the finish reason
    assert len(chunks) == len(script) + 1
    assert sum(1 for c in chunks if c.choices[0].text == "") == silent + 1
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert len(chat) == 1 + len(script) + 1  # the role opens it
    assert "".join(c.choices[0].delta.content or "" for c in chat) == expected


async def test_the_pool_reads_each_workers_own_prompt_rate(fake_workers):
    from baton.router.pool import Membership, WorkerPool
    from baton.router.worker_client import WorkerClient

    measured, cold = await fake_workers("decode"), await fake_workers("decode")
    measured.prefill_seconds_per_token = 0.006
    worker_client = WorkerClient()
    pool = WorkerPool(worker_client)
    pool.set_members([Membership(measured.url), Membership(cold.url)])
    try:
        await pool.poll_once()
        rates = {s.url: s.prefill_s_per_token for s in pool.snapshots()}
        assert rates == {measured.url: 0.006, cold.url: None}
    finally:
        await worker_client.close()

