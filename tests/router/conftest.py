"""Fixtures for router tests: the bundled model's tokenizer, fake workers, a live router."""

from __future__ import annotations

import pytest
import pytest_asyncio
from fake_worker import FakeWorker


@pytest.fixture(scope="session")
def model_info():
    from baton.router.tokenizing import load_model_info

    return load_model_info(None, served_name="smollm2")


@pytest.fixture(scope="session")
def script(model_info) -> list[int]:
    """What the fake workers 'generate'."""
    return model_info.tokenizer.encode(" The capital of France is Paris. Très bien — ✓")


@pytest_asyncio.fixture
async def fake_workers(model_info, script):
    started: list[FakeWorker] = []

    async def make(role: str, **kwargs) -> FakeWorker:
        worker = await FakeWorker(role, script, model_info.tokenizer.eos_token_ids[0], **kwargs).start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        await worker.stop()


@pytest.fixture(scope="session")
def real_workers():
    """A real prefill worker and a real decode worker whose pool holds ~7k tokens: one chat
    request reserving the rest of SmolLM2's 8k context would take all of it."""
    from tests.server.workers import start_workers

    pool = ["--block-size", "16", "--kv-cache-memory-gb", "0.3"]
    prefill, decode = start_workers([("p", "prefill", pool, None), ("d", "decode", pool, None)])
    yield prefill, decode
    for w in (prefill, decode):
        w.stop()
