"""Load: 256 streaming clients at once against `baton up --prefill 1 --decode 1`. None may
fail, except a deliberate 429 that carries Retry-After; afterwards every worker's free
blocks are back at their idle count."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.faults.fault_stack import gather_within, prompt_for
from tests.server.workers import new_id

pytestmark = pytest.mark.slow
CLIENTS = 256
TOKENS = 8  # each: small, so the whole run takes about a minute on a busy CPU
# one client in 64 has a long prompt, prefilled on the prefill worker: each takes 3 s there, one
# after another (the fault tests slow its layers), so more would only lengthen the test
REMOTE_EVERY = 64


def test_256_concurrent_streaming_clients(stack):
    idle = stack.free_blocks()
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=CLIENTS + 16))
    api = stack.api(timeout_s=600, http_client=http)

    async def one(i: int):
        path = "remote" if i % REMOTE_EVERY == 0 else "local"
        try:
            stream = await api.completions.create(
                model=stack.model, prompt=prompt_for(path, new_id()), max_tokens=TOKENS, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            finish, usage = None, None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                usage = chunk.usage or usage
            return finish, usage.completion_tokens
        except openai.RateLimitError as e:
            return "429", e.response.headers.get("retry-after")

    started = time.monotonic()
    outcomes = asyncio.run(gather_within(600, *(one(i) for i in range(CLIENTS))))
    seconds = time.monotonic() - started
    served = [o for o in outcomes if o == ("length", TOKENS)]
    refused = [o for o in outcomes if isinstance(o, tuple) and o[0] == "429"]
    failed = [o for o in outcomes if o not in served and o not in refused]
    print(f"\n{CLIENTS} clients in {seconds:.1f}s: {len(served)} served, {len(refused)} refused (429), "
          f"{len(failed)} failed")
    assert failed == [], failed[:5]
    assert all(retry is not None and int(retry) >= 1 for _, retry in refused), refused[:5]
    stack.wait_idle(idle, 10.0)
