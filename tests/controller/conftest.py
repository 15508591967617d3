"""Fixtures for the controller tests: the operator tests' kmock harness is reused as is."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest_asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from operator_harness import RESOURCES, declare  # noqa: E402


@pytest_asyncio.fixture
async def emulator(kmock: Any) -> Any:
    for key, kind in RESOURCES.items():
        declare(kmock, key, kind)
    return kmock
