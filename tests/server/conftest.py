"""Worker processes shared by the server tests (started once, in parallel, on first use)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.server.workers import generate, start_workers

# eight prompts of mixed lengths (4 to 51 tokens): most span several prefill chunks (16) and
# the last ones more than one decode block (32), so chunking and re-blocking both matter
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "The capital of Germany is",
    "1, 2, 3, 4, 5,",
    "Ünïcödé tëxt 東京 and emojis 🎉 are",
    "Once upon a time in a land far away, there lived a wise old owl who",
    "Explain photosynthesis in simple terms. Photosynthesis is the process by which green "
    "plants and some other organisms use sunlight to synthesize foods from carbon dioxide and "
    "water. Photosynthesis in plants generally involves the green pigment chlorophyll and",
    "Here is a list of the planets of the solar system with one fact about each of them, "
    "starting from the one closest to the sun: Mercury is the smallest planet and has no "
    "moons. Venus is the hottest planet because of its thick atmosphere. Earth is",
]
NEW_TOKENS = 12
GREEDY = {"max_tokens": NEW_TOKENS, "ignore_eos": True}
SMALL_POOL = ["--kv-cache-memory-gb", "0.05"]
DOOMED_LAYER_DELAY_S = 0.1  # 30 layers: its transfer spans ~3 s, time to kill it mid-way


@pytest.fixture(scope="session")
def cluster():
    """prefill (16-token blocks, 16-token chunks, a corruptible layer for `corrupt-` ids),
    decode over TCP (32-token blocks, SCHED_IDLE when switched to prefill), decode over shared
    memory (16), a colocated one, and a slow prefill worker that one test kills (all started
    together: startup dominates)."""
    specs = [
        ("prefill", "prefill", ["--block-size", "16", "--chunk-size", "16", "--kv-cache-memory-gb", "0.1"],
         {"BATON_TEST_CORRUPT_LAYER": "5", "BATON_TEST_CORRUPT_PREFIX": "corrupt-"}),
        # it yields the CPU while a test has switched it to prefill (test_migration.py)
        ("decode-tcp", "decode", ["--block-size", "32", "--kv-transport", "tcp", "--prefill-cpu-priority", "idle",
                                  *SMALL_POOL], None),
        ("decode-shm", "decode", ["--block-size", "16", "--kv-transport", "shm", *SMALL_POOL], None),
        ("both", "both", ["--block-size", "16", *SMALL_POOL], None),
        ("doomed-prefill", "prefill", ["--block-size", "16", "--chunk-size", "0", *SMALL_POOL],
         {"BATON_TEST_LAYER_DELAY_S": str(DOOMED_LAYER_DELAY_S)}),
    ]
    workers = start_workers(specs)
    yield dict(zip([s[0] for s in specs], workers))
    for w in workers:
        w.stop()


@pytest.fixture(scope="session")
def prompt_ids(cluster):
    return [cluster["both"].tokenize(p) for p in PROMPTS]


@pytest.fixture(scope="session")
def reference(cluster, prompt_ids):
    """The colocated worker's greedy tokens for every prompt."""

    async def run_all():
        return await asyncio.gather(*(generate(cluster["both"], ids, GREEDY) for ids in prompt_ids))

    results = asyncio.run(run_all())
    for r in results:
        assert not r["errors"] and len(r["token_ids"]) == NEW_TOKENS, r
    return [r["token_ids"] for r in results]


@pytest.fixture
def blocks_restored(cluster):
    """After the test, every decode worker's free KV blocks are back to where they started."""
    decoders = [cluster["decode-tcp"], cluster["decode-shm"], cluster["prefill"]]
    before = [w.state()["free_blocks"] for w in decoders]
    yield
    after = [w.wait_free_blocks(b) for w, b in zip(decoders, before)]
    assert after == before, f"free KV blocks {after} != {before} at the start"


@pytest.fixture
def roles_restored(cluster):
    """After the test, every shared worker is active in its starting role again: a drain test
    that fails half-way must not leave a drained worker to the tests after it."""
    names = ["prefill", "decode-tcp", "decode-shm", "both"]
    roles = {n: cluster[n].state()["role"] for n in names}
    yield
    for name in names:
        worker = cluster[name]
        state = worker.state()
        if (state["role"], state["state"]) == (roles[name], "active"):
            continue
        worker.post("/internal/drain", {"peers": []})
        deadline = time.monotonic() + 60
        while worker.get("/internal/drain").json()["state"] != "drained":
            assert time.monotonic() < deadline, f"{name} did not drain"
            time.sleep(0.1)
        switched = worker.post("/internal/role", {"role": roles[name]})
        assert switched.status_code == 200, f"{name} did not go back to {roles[name]}: {switched.text}"
