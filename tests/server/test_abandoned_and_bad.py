"""A client that goes away, a router that dies before it claims its stream, and hostile
sampling parameters on the internal API, against real worker processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from tests.server.workers import TOKEN, generate, new_id, start_workers

pytestmark = pytest.mark.slow  # two worker processes start first (30-60 s on a busy machine)

LONG = {"max_tokens": 3000, "ignore_eos": True}  # minutes of decoding: it must be stopped
CLAIM_TIMEOUT_S = 2.0
QUEUE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def pair():
    specs = [
        ("abandon-both", "both", ["--block-size", "16", "--kv-cache-memory-gb", "0.3",
                                  "--queue-timeout", str(QUEUE_TIMEOUT_S)],
         {"BATON_STREAM_CLAIM_TIMEOUT_S": str(CLAIM_TIMEOUT_S)}),
        ("abandon-prefill", "prefill", ["--block-size", "16", "--kv-cache-memory-gb", "0.1"], None),
    ]
    workers = start_workers(specs)
    yield dict(zip(["both", "prefill"], workers))
    for w in workers:
        w.stop()


def _wait_free(worker, idle: int, within_s: float) -> float:
    """Seconds until the worker's free blocks are back at `idle` (fails after `within_s`)."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if worker.state()["free_blocks"] == idle:
            return time.monotonic() - start
        time.sleep(0.05)
    pytest.fail(f"free blocks {worker.state()['free_blocks']} != {idle} after {within_s}s")


CLIENT = textwrap.dedent("""
    import sys, httpx
    url, token, body = sys.argv[1], sys.argv[2], sys.argv[3]
    with httpx.stream("POST", url, content=body, timeout=60,
                      headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"}) as r:
        lines = r.iter_lines()  # referenced: a dropped iterator would close the stream
        for line in lines:
            if line.startswith("data:"):
                print("streaming", line[:300].replace(chr(10), " "), flush=True)
                break
        sys.stdin.read()  # hold the connection open until killed
""")


def test_a_killed_client_frees_its_blocks_within_a_second(pair):
    worker = pair["both"]
    idle = worker.state()["free_blocks"]
    ids = worker.tokenize("Write a very long story about a lighthouse keeper:")
    body = json.dumps({"request_id": new_id("killed"), "prompt_token_ids": ids, "params": LONG})
    client = subprocess.Popen([sys.executable, "-c", CLIENT, worker.url + "/internal/generate", TOKEN, body],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first = client.stdout.readline()
        assert first.startswith("streaming") and "error" not in first, first
        time.sleep(0.5)
        assert worker.state()["free_blocks"] < idle  # it holds blocks while it decodes
    finally:
        client.kill()
        client.wait(10)
    assert _wait_free(worker, idle, 1.0) <= 1.0
    assert worker.state()["running"] == 0


def test_a_stream_nobody_claims_is_aborted(pair):
    """Reserve and prefill as a router does, then never come for the tokens (the router
    died): the decode worker stops the sequence soon after its claim deadline."""
    decode, prefill = pair["both"], pair["prefill"]
    idle = decode.state()["free_blocks"]
    ids = decode.tokenize("Tell me everything about the history of the printing press:")
    rid = new_id("orphan")
    reply = decode.post("/internal/reserve", {"request_id": rid, "prompt_token_ids": ids, "params": LONG,
                                              "headroom_tokens": 64})
    assert reply.status_code == 200, reply.text
    answer = prefill.post("/internal/prefill", {"request_id": rid, "prompt_token_ids": ids, "params": LONG,
                                                "ticket": reply.json()["ticket"]})
    assert answer.status_code == 200, answer.text
    assert decode.state()["running"] == 1
    _wait_free(decode, idle, CLAIM_TIMEOUT_S + 3.0)
    assert decode.state()["running"] == 0


def test_a_request_without_room_is_a_429_after_the_queue_deadline_then_runs_once_room_is_back(pair):
    """The answer to generate waits until the engine runs the request: with every block
    reserved it never does, so past the queue deadline the answer is 429 and nothing of it
    is left; with room back the same request streams at once."""
    worker = pair["both"]
    idle = worker.state()["free_blocks"]
    hog = new_id("hog")
    held = worker.post("/internal/reserve", {"request_id": hog, "prompt_token_ids": [1, 2, 3],
                                             "params": {"max_tokens": 1}, "headroom_tokens": idle * 16 - 4})
    assert held.status_code == 200 and worker.state()["free_blocks"] == 0
    ids = worker.tokenize("Hello there")
    try:
        started = time.monotonic()
        refused = worker.post("/internal/generate", {"request_id": new_id("queued"), "prompt_token_ids": ids,
                                                     "params": {"max_tokens": 4}})
        waited = time.monotonic() - started
    finally:
        worker.post(f"/internal/abort/{hog}")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_timeout", refused.text
    assert QUEUE_TIMEOUT_S <= waited < QUEUE_TIMEOUT_S + 5
    state = worker.state()
    assert state["waiting"] == 0 and state["running"] == 0 and state["free_blocks"] == idle
    served = asyncio.run(generate(worker, ids, {"max_tokens": 4, "ignore_eos": True}))
    assert len(served["token_ids"]) == 4 and not served["errors"]


BAD_PARAMS = [
    ('{"temperature": NaN}', "temperature"),
    ('{"temperature": Infinity}', "temperature"),
    ('{"top_p": NaN}', "top_p"),
    ('{"top_k": 1.5}', "top_k"),
    ('{"logprobs": 2.5}', "logprobs"),
    ('{"stop": [1, 2]}', "stop"),
    ('{"stop": {"a": 1}}', "stop"),
    ('{"stop_token_ids": "abc"}', "stop_token_ids"),
    ('{"stop_token_ids": [1.5]}', "stop_token_ids"),
    ('{"stop": ' + json.dumps(["x"] * 17) + "}", "at most 16 stop strings"),
    ('{"stop": ["' + "x" * 300 + '"]}', "256 characters"),
    ('{"seed": 1e400}', "seed"),
    ('{"max_tokens": true}', "max_tokens"),
]


@pytest.mark.parametrize("path", ["/internal/generate", "/internal/reserve"])
def test_bad_sampling_params_answer_400_and_leave_nothing_behind(pair, path):
    worker = pair["both"]
    ids = worker.tokenize("Hello there")
    for raw, field in BAD_PARAMS:
        body = f'{{"request_id": "{new_id("bad")}", "prompt_token_ids": {json.dumps(ids)}, "params": {raw}}}'
        reply = httpx.post(worker.url + path, content=body, timeout=30,
                           headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        assert reply.status_code == 400, (raw, reply.status_code, reply.text)
        error = reply.json()["error"]
        assert field in error["message"], (raw, error)
    state = worker.state()
    assert state["running"] == 0 and state["waiting"] == 0 and state["reservations"] == 0


def test_after_bad_requests_the_worker_drains_and_switches_role(pair):
    worker = pair["both"]
    ids = worker.tokenize("Hello there")
    for raw, _ in BAD_PARAMS:
        body = f'{{"request_id": "{new_id("bad")}", "prompt_token_ids": {json.dumps(ids)}, "params": {raw}}}'
        httpx.post(worker.url + "/internal/generate", content=body, timeout=30,
                   headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert worker.post("/internal/drain", {"peers": []}).status_code == 202
    deadline = time.monotonic() + 10
    while worker.get("/internal/drain").json()["state"] != "drained":
        assert time.monotonic() < deadline, worker.get("/internal/drain").json()
        time.sleep(0.1)
    switched = worker.post("/internal/role", {"role": "both"})
    assert switched.status_code == 200, switched.text
    assert worker.get("/ready").status_code == 200
    served = asyncio.run(generate(worker, ids, {"max_tokens": 4, "ignore_eos": True}))
    assert len(served["token_ids"]) == 4 and not served["errors"]
