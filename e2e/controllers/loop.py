"""Level-based controller loop: any change to a watched resource schedules one full pass."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from e2e.apiserver.errors import ApiError
from e2e.apiserver.store import Event, Store

log = logging.getLogger(__name__)


async def run_controller(store: Store, name: str, watched: set[tuple[str, str]],
                         reconcile: Callable[[], None], resync: float = 5.0,
                         settle: float = 0.05) -> None:
    """Call `reconcile()` after changes to `watched` (group, plural) keys, and every `resync`."""
    wake = asyncio.Event()

    def listener(res: object, event: Event) -> None:
        if getattr(res, "key", None) in watched:
            wake.set()

    store.listeners.append(listener)
    try:
        while True:
            wake.clear()
            try:
                reconcile()
            except ApiError as e:
                log.warning("%s: %s", name, e)
            except Exception:  # a controller never dies of one bad object
                log.exception("%s failed", name)
            try:
                await asyncio.wait_for(wake.wait(), resync)
                await asyncio.sleep(settle)  # let a burst of writes land before the next pass
            except TimeoutError:
                pass
    finally:
        store.listeners.remove(listener)
