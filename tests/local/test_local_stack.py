"""System tests: `baton up` (Ray, real workers, the router) driven by the official OpenAI
client. One stack for the module: 1 prefill + 1 decode worker, float32, a small KV pool,
the prefill worker at SCHED_IDLE, and a fixed disaggregation threshold so short prompts stay
local and long ones go remote.
"""

from __future__ import annotations

import asyncio
import os
import re

import httpx
import openai
import pytest
from stack_harness import UpProcess, assert_all_exit

pytestmark = pytest.mark.slow
THRESHOLD = 48  # tokens: below, the decode worker prefills locally
WORKER_ARGS = ["--worker-arg=--dtype=float32", "--worker-arg=--num-kv-blocks=384",
               "--worker-arg=--max-num-seqs=64"]
LONG_PROMPT = ("Baton moves the KV cache from a prefill worker to a decode worker, like the baton of a "
               "relay race. The prefill worker computes the prompt; the decode worker streams tokens. ") * 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    up = UpProcess(["--prefill", "1", "--decode", "1", "--port", "0", "--prefill-cpu-priority", "idle",
                    "--disagg-threshold", str(THRESHOLD), *WORKER_ARGS], tmp_path_factory.mktemp("up"))
    try:
        up.wait_up()
        yield up
    finally:
        up.stop()


@pytest.fixture(scope="module")
def api(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(api) -> str:
    return api.models.list().data[0].id


@pytest.fixture(scope="module")
def engine():
    from baton.engine.engine import Engine

    return Engine(dtype="float32", threads=1, num_kv_blocks=256)


def routes(stack) -> dict[str, float]:
    text = httpx.get(f"{stack.url}/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'baton_router_routes_total\{path="(\w+)"\} (\S+)', text)}


def test_chat_and_completions_stream_and_not(api, model):
    chat = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                       max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
    pieces = [c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0,
        stream=True) if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    done = api.completions.create(model=model, prompt="The sky is", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=model, prompt="The sky is", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == done.choices[0].text


@pytest.mark.parametrize("path", ["local", "remote"])
def test_greedy_output_equals_the_offline_engine(api, model, engine, stack, path):
    from baton.engine.sampling import SamplingParams

    prompt = "Q: What is the capital of France?\nA:" if path == "local" else LONG_PROMPT + f" ({path})"
    ids = engine.tokenizer.encode(prompt)
    assert (len(ids) < THRESHOLD) == (path == "local")
    before = routes(stack).get(path, 0)
    offline = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.0))[0]
    served = api.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0)
    assert served.choices[0].text == offline.text
    assert served.usage.completion_tokens == len(offline.token_ids)
    assert routes(stack).get(path, 0) == before + 1  # it really took that path


@pytest.mark.parametrize("path", ["local", "remote"])
def test_seeded_sampling_equals_the_offline_engine(api, model, engine, stack, path):
    """OpenAI's `seed`: the same tokens as the offline engine, whether the decode worker
    prefilled the prompt or a prefill worker did and handed its random stream over."""
    from baton.engine.sampling import SamplingParams

    before = routes(stack).get(path, 0)
    for seed in (100, 101):
        # a prompt of its own each time: a cached prefix would make a long one local
        prompt = f"Q: Name colour {seed}.\nA:" if path == "local" else f"Seed {seed}. {LONG_PROMPT}"
        ids = engine.tokenizer.encode(prompt)
        offline = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95,
                                                        seed=seed, ignore_eos=True))[0]
        served = api.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0.8,
                                        top_p=0.95, seed=seed, extra_body={"ignore_eos": True})
        assert served.choices[0].text == offline.text, f"seed {seed} on the {path} path"
    assert routes(stack).get(path, 0) == before + 2  # both really took that path


def test_fifty_concurrent_requests_all_complete(stack, model):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=240)

        async def one(i: int) -> int:
            kwargs = dict(model=model, prompt=f"Count to {i}:", max_tokens=8, extra_body={"ignore_eos": True})
            if i % 2:
                return (await client.completions.create(**kwargs)).usage.completion_tokens
            stream = await client.completions.create(**kwargs, stream=True)
            return len([c async for c in stream if c.choices and c.choices[0].text])

        return await asyncio.gather(*(one(i) for i in range(50)))

    counts = asyncio.run(main())
    assert len(counts) == 50 and all(c >= 1 for c in counts)


def test_bad_inputs_get_4xx(stack, model):
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        assert http.post("/v1/chat/completions", content=b"{oops",
                         headers={"content-type": "application/json"}).status_code == 400
        cases = [{"model": "missing", "prompt": "x"}, {"model": model, "prompt": "x", "max_tokens": -1},
                 {"model": model, "prompt": "x", "max_tokens": 10**8},
                 {"model": model, "prompt": [7] * 9000}, {"model": model, "prompt": "x", "n": 2}]
        for body in cases:
            r = http.post("/v1/completions", json=body)
            assert 400 <= r.status_code < 500 and r.json()["error"]["message"], body
        assert http.post("/v1/chat/completions", json={"model": model}).status_code == 400


def test_the_prefill_worker_yields_its_core_and_the_decode_worker_does_not(stack):
    """With a core each (baton up pins them) and --prefill-cpu-priority idle, the prefill worker
    runs at SCHED_IDLE, so the threads that wake up beside the two (the router's, the decode
    worker's) go to its core."""
    from baton.server.cpu_priority import thread_policies

    prefill = stack.server("baton.server.main", "--role prefill")
    decode = stack.server("baton.server.main", "--role decode")
    own_cores = len(os.sched_getaffinity(0)) >= 2
    assert set(thread_policies(prefill.pid).values()) == {os.SCHED_IDLE if own_cores else os.SCHED_OTHER}
    assert set(thread_policies(decode.pid).values()) == {os.SCHED_OTHER}
    if own_cores:
        log = next(stack.log_dir.glob("worker-*-prefill.log")).read_text()
        assert "threads at CPU priority idle (SCHED_IDLE)" in log


def test_sigterm_stops_every_process(stack):
    """Last in the module: it stops the module's stack (workers, router, Ray) with SIGTERM."""
    started = stack.descendants()
    servers = [" ".join(p.cmdline()) for p in started if "baton.server.main" in " ".join(p.cmdline())]
    assert len(servers) == 2 and any("baton.router.main" in " ".join(p.cmdline()) for p in started)
    assert httpx.get(f"{stack.url}/health").status_code == 200
    code = stack.stop()
    assert code == 0, stack.output()
    assert_all_exit(started)
