"""Fixtures for the operator tests; the helpers live in operator_harness.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf
import pytest
import pytest_asyncio
from operator_harness import RESOURCES, FakeWorker, declare, running_operator

from baton.operator.config import OperatorConfig


@pytest_asyncio.fixture
async def emulator(kmock: Any) -> Any:
    for key, kind in RESOURCES.items():
        declare(kmock, key, kind)
    return kmock


@pytest_asyncio.fixture
async def fake_worker() -> AsyncIterator[FakeWorker]:
    worker = FakeWorker()
    await worker.start()
    yield worker
    await worker.stop()


@pytest.fixture
def operator_config(emulator: Any, fake_worker: FakeWorker) -> OperatorConfig:
    return OperatorConfig(
        connection=kopf.ConnectionInfo(server=str(emulator.url).rstrip("/")),
        worker_port=fake_worker.port,
        worker_timeout=2.0,
        resync_seconds=1.0,
        busy_seconds=0.2,
        request_timeout=5.0,
        watch_timeout=30,
    )


@pytest.fixture
def operator_factory(operator_config: OperatorConfig) -> Callable[[], Any]:
    return lambda: running_operator(operator_config)
