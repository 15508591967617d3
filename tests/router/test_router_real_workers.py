"""The router in front of real `baton worker` processes: a decode pool that requests without
max_tokens cannot fill (issue 15 item 4), and KV blocks freed on the worker within a second
of a client leaving, streamed or not (item 5)."""

from __future__ import annotations

import httpx
import openai
import pytest
import pytest_asyncio
from router_harness import running_router

from baton.router.dispatch import Deadlines
from tests.server.workers import TOKEN, free_blocks, wait_free

pytestmark = pytest.mark.asyncio
HELD = 4  # chat requests held open at once, none with max_tokens
MESSAGES = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]


@pytest.fixture
def workers(real_workers):
    return real_workers


def metric(text: str, name: str, label: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line)


@pytest_asyncio.fixture
async def router(workers, model_info):
    prefill, decode = workers
    async with running_router(model_info, [prefill.url, decode.url], internal_token=TOKEN,
                              disagg_threshold=0, deadlines=Deadlines(reserve_wait_s=1.0)) as url:
        yield url


async def test_chat_requests_without_max_tokens_do_not_fill_the_decode_pool(workers, router, model_info):
    _, decode = workers
    idle = await free_blocks(decode)
    assert idle * 16 < model_info.max_model_len  # one full-context reservation would not fit
    api = openai.AsyncOpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0, timeout=60)
    streams = []
    try:
        for _ in range(HELD):
            stream = await api.chat.completions.create(
                model="smollm2", messages=MESSAGES, stream=True, temperature=0,
                extra_body={"ignore_eos": True})
            streams.append(stream)
            async for chunk in stream:  # on its way: the decode worker holds it
                if chunk.choices and chunk.choices[0].delta.content:
                    break
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{router}/metrics")).text
        assert metric(text, "baton_router_routes_total", 'path="remote"') == HELD
        assert metric(text, "baton_router_retries_total", "fallback_local") == 0
        assert await free_blocks(decode) > idle // 2  # room left for more
    finally:
        for stream in streams:
            await stream.close()  # the clients leave mid-stream: their blocks come back
    await wait_free(decode, idle, 1.0)


@pytest.mark.parametrize("path", ["remote", "local"])
async def test_a_non_streaming_client_that_leaves_frees_its_blocks_within_a_second(
        workers, model_info, path):
    prefill, decode = workers
    idle = await free_blocks(decode)
    async with running_router(model_info, [prefill.url, decode.url], internal_token=TOKEN,
                              disagg_threshold=0 if path == "remote" else 10**6) as url:
        impatient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3)
        with pytest.raises(openai.APITimeoutError):  # 2000 tokens take far longer on a CPU
            await impatient.completions.create(model="smollm2", prompt="Once upon a time",
                                               max_tokens=2000, extra_body={"ignore_eos": True})
        await wait_free(decode, idle, 1.0)
        async with httpx.AsyncClient() as http:
            state = (await http.get(f"{url}/router/state")).json()
        assert state["admission"]["running"] == 0
