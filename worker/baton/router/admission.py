"""Bounded admission: at most `max_running` requests in flight, `max_waiting` queued behind
them; beyond that the router answers 429 with a Retry-After estimate."""

from __future__ import annotations

import asyncio
import math


class Overloaded(Exception):
    def __init__(self, retry_after_s: int, reason: str):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class AdmissionQueue:
    def __init__(self, max_running: int = 256, max_waiting: int = 1024, wait_timeout_s: float = 60.0):
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.wait_timeout_s = wait_timeout_s
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_running)
        self._mean_duration_s = 1.0  # smoothed request duration, for Retry-After

    def retry_after(self) -> int:
        """Seconds until a queued request could expect a slot: queue length over the rate
        at which slots free up."""
        drain_rate = self.max_running / max(self._mean_duration_s, 1e-3)
        return max(1, math.ceil((self.waiting + 1) / drain_rate))

    async def acquire(self) -> None:
        if self.running >= self.max_running and self.waiting >= self.max_waiting:
            raise Overloaded(self.retry_after(), f"the router is at capacity ({self.running} running, "
                             f"{self.waiting} queued); retry later")
        if not self._slots.locked():  # a free slot: take it without a timeout task
            await self._slots.acquire()
            self.running += 1
            return
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.wait_timeout_s)
        except TimeoutError:
            raise Overloaded(self.retry_after(), "timed out waiting for a free slot") from None
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self, duration_s: float | None = None) -> None:
        self.running -= 1
        self._slots.release()
        if duration_s is not None and duration_s > 0:
            self._mean_duration_s = 0.9 * self._mean_duration_s + 0.1 * duration_s
