"""`baton up`'s kubelet: restart any server process that exits, with back-off (restart.py).

One thread polls every watched process. An exit is logged and its restart scheduled after
the back-off; the restart runs the same command (same role, ports and arguments), so the
router finds a worker again through its own health polls, and clients find the router at
the same address. Each restart is logged and counted, and so is the moment the server
answers /ready again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx

from baton.local.restart import Backoff, crash_streak, restart_delay


class Process(Protocol):
    def poll(self) -> int | None: ...  # exit code, None while it runs
    def start(self) -> int: ...  # pid of the new process


@dataclass
class Watched:
    name: str
    process: Process
    ready_url: str | None
    started_at: float
    streak: int = 0  # crashes in a row
    restarts: int = 0
    restart_at: float | None = None  # a restart is due then
    exited_at: float | None = None
    awaiting_ready: bool = False


class Supervisor:
    def __init__(self, backoff: Backoff | None = None, say: Callable[[str], None] = print,
                 interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.backoff = backoff or Backoff()
        self.say = say
        self.interval_s = interval_s
        self.clock = clock
        self.watched: list[Watched] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, name: str, process: Process, ready_url: str | None = None) -> None:
        self.watched.append(Watched(name, process, ready_url, self.clock()))

    @property
    def restarts(self) -> dict[str, int]:
        return {w.name: w.restarts for w in self.watched}

    # -- one pass -----------------------------------------------------------------------
    def tick(self) -> None:
        for w in self.watched:
            if self._stop.is_set():
                return
            try:
                self._check(w, self.clock())
            except Exception as e:  # a failed poll or start is retried on the next pass
                self.say(f"{w.name}: supervising failed ({type(e).__name__}: {e}); trying again")

    def _check(self, w: Watched, now: float) -> None:
        if w.restart_at is not None:
            if now >= w.restart_at:
                self._restart(w, now)
            return
        code = w.process.poll()
        if code is None:
            if w.awaiting_ready and self._ready(w):
                w.awaiting_ready = False
                self.say(f"{w.name} is ready again, {now - w.exited_at:.1f}s after it exited")
            return
        ran_for = now - w.started_at
        w.streak = crash_streak(w.streak, ran_for, self.backoff)
        delay = restart_delay(w.streak, self.backoff)
        w.exited_at, w.restart_at, w.awaiting_ready = now, now + delay, False
        self.say(f"{w.name} exited with code {code} after {ran_for:.1f}s; restarting in {delay:g}s "
                 f"({w.streak} exit(s) in a row)")

    def _restart(self, w: Watched, now: float) -> None:
        w.restart_at = now + restart_delay(w.streak, self.backoff)  # kept if start() raises
        pid = w.process.start()
        w.restarts += 1
        w.started_at, w.restart_at, w.awaiting_ready = now, None, w.ready_url is not None
        self.say(f"{w.name} restarted (pid {pid}; restart {w.restarts})")

    @staticmethod
    def _ready(w: Watched) -> bool:
        try:
            return httpx.get(w.ready_url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    # -- the thread ---------------------------------------------------------------------
    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="baton-supervisor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def stop(self, timeout_s: float = 30.0) -> None:
        """No restart starts after this returns (one in progress finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
