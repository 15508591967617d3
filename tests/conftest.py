"""Fixtures shared by every test tier."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def lib():
    """The native library (native/build.py) the CPU engine uses; its tests skip without it."""
    from baton.engine.native import build

    loaded = build.load()
    if loaded is None:
        pytest.skip(f"native library unavailable: {build.failure()}")
    return loaded
