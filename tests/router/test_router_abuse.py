"""Abuse suite (issue 15): hypothesis throws hostile bodies at a real `baton router` process in
front of real workers. Every answer is a 2xx or an OpenAI-shaped 4xx within a deadline, never
a 5xx or a hung connection, and the stack still serves afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.workers import TOKEN, free_port

pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # big reprs
DEADLINE_S = 30.0  # per request: a slower answer counts as a hang
EXAMPLES = 100  # per endpoint; ~30-60 s in all with the workers' start, on two loaded cores
MAX_MODEL_LEN = 512  # long prompts are refused fast instead of prefilled for seconds

numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 255, 256, 257, MAX_MODEL_LEN - 1, MAX_MODEL_LEN, 49152,
                     2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**100]),
    st.floats(allow_nan=True, allow_infinity=True),
)
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\x00", "\ud800", "a\udfffb", "🎉" * 50, "東京" * 20, "\u202e",
                     "<|im_start|>", "{{ 7*7 }}", "x" * 300, "y" * 100_000]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
small_budget = st.integers(min_value=1, max_value=6)
plain_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30)
# bodies a client could mean: each field valid, unicode everywhere
sane = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 60_000),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(plain_text, st.lists(plain_text, max_size=16)),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=20),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "model": st.just("smollm2"),
}
# what each field may be instead: wrong types, numbers at and past their limits, nesting
hostile = {
    **{name: values for name in sane},
    "top_k": st.one_of(numbers, values),
    "seed": st.one_of(numbers, values),
    "stop": st.one_of(st.lists(texts, max_size=20), texts, values),
    "stop_token_ids": st.one_of(st.lists(numbers, max_size=300), values),
    "max_tokens": st.one_of(numbers, st.sampled_from([0, MAX_MODEL_LEN, "4", 1.5]), values),
    "n": st.one_of(st.sampled_from([1, 2]), values),
    "logprobs": values,
    "presence_penalty": values,
}
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": texts})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "", "👾"]),
                                 "content": st.one_of(texts, st.lists(part, max_size=3))})
fields = {
    "completion": ({"prompt": st.one_of(plain_text, st.lists(st.integers(0, 49151), min_size=1, max_size=40))},
                   {"prompt": st.one_of(texts, st.lists(numbers, max_size=40), values)}),
    "chat": ({"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": plain_text}),
                                   min_size=1, max_size=3)},
             {"messages": st.one_of(st.lists(message, max_size=4), values),
              "max_completion_tokens": hostile["max_tokens"], "add_generation_prompt": values}),
}


def bodies(kind: str) -> st.SearchStrategy:
    """A sane body, then one to three of its fields made hostile."""
    required, extra_hostile = fields[kind]
    base = st.fixed_dictionaries({**required, "max_tokens": small_budget}, optional=sane)
    bad = {**hostile, **extra_hostile}

    @st.composite
    def mutated(draw) -> dict:
        body = draw(base)
        for name in draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3, unique=True)):
            body[name] = draw(bad[name])
        return body

    return st.one_of(base, mutated())


def raw(kind: st.SearchStrategy) -> st.SearchStrategy:
    """A body as bytes: JSON of the strategy (NaN and all), now and then something worse."""
    return st.one_of(
        kind.map(lambda b: json.dumps(b).encode()),
        kind.map(lambda b: json.dumps(b).encode()),
        kind.map(lambda b: json.dumps(b).encode()),
        values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(1, 50_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    )


@pytest.fixture(scope="module")
def router(real_workers):
    port = free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"baton-abuse-router-{port}.log"), "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "router", "--port", str(port), "--served-model-name",
         "smollm2", "--max-model-len",
         str(MAX_MODEL_LEN), "--workers", ",".join(w.url for w in real_workers)],
        env={**os.environ, "BATON_INTERNAL_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1", "BATON_API_KEY": ""},
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the router did not start"
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(20)
    log.close()


def check(http: httpx.Client, path: str, body: bytes) -> int:
    with http.stream("POST", path, content=body, headers={"content-type": "application/json"}) as r:
        payload = r.read()  # whole answer, streamed or not, within the client's deadline
    assert r.status_code < 500, (r.status_code, payload[:300], body[:300])
    if r.status_code >= 400:
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and len(error["message"]) < 1000
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert not any('"error"' in e[:12] for e in events), events
    else:
        assert json.loads(payload)["choices"], payload[:300]
    return r.status_code


@pytest.mark.parametrize("path,kind", [("/v1/completions", "completion"),
                                       ("/v1/chat/completions", "chat")])
def test_hostile_bodies_get_2xx_or_openai_4xx_and_the_stack_still_serves(router, path, kind):
    seen: dict[int, int] = {}
    with httpx.Client(base_url=router, timeout=DEADLINE_S) as http:

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(body=raw(bodies(kind)))
        def fuzz(body: bytes) -> None:
            status = check(http, path, body)
            seen[status] = seen.get(status, 0) + 1

        fuzz()
    print(path, "answers by status:", dict(sorted(seen.items())))
    refused = sum(n for status, n in seen.items() if status >= 400)
    assert seen.get(200, 0) >= 3 and refused >= EXAMPLES // 10  # both kinds were tried
    api = openai.OpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0, timeout=DEADLINE_S)
    done = api.chat.completions.create(model="smollm2", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hello"}])
    assert done.choices[0].message.content and done.usage.completion_tokens >= 1
