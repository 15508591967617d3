"""`baton up`'s kubelet: restart any server process that exits, or that fails its liveness
probe as a pod's would (a tensor-parallel worker that lost a rank says so on /health), with
back-off (restart.py).

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
    def stop(self) -> int | None: ...  # terminate it (killed past a deadline): its exit code


@dataclass(frozen=True)
class Liveness:
    """The pods' liveness probe, as `baton up` runs it: /health every `period_s`; after
    `failures` failed probes in a row (an answer other than 200, or none within
    `timeout_s`) the server is stopped and restarted. Probed only once it has been ready."""

    period_s: float = 5.0
    timeout_s: float = 5.0
    failures: int = 3


@dataclass
class Watched:
    name: str
    process: Process
    ready_url: str | None
    started_at: float
    health_url: str | None = None
    streak: int = 0  # crashes in a row
    restarts: int = 0
    restart_at: float | None = None  # a restart is due then
    exited_at: float | None = None
    awaiting_ready: bool = False
    failed_probes: int = 0  # liveness probes failed in a row
    probe_at: float = 0.0


class Supervisor:
    def __init__(self, backoff: Backoff | None = None, say: Callable[[str], None] = print,
                 interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 liveness: Liveness | None = None):
        self.backoff = backoff or Backoff()
        self.liveness = liveness or Liveness()
        self.say = say
        self.interval_s = interval_s
        self.clock = clock
        self.watched: list[Watched] = []
        # one client for every probe: a fresh one per request (httpx.get) builds a TLS
        # context each time, ~24 ms of CPU, three servers' worth every period in one burst
        # that took a core from the workers it watches
        self._http: httpx.Client | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, name: str, process: Process, ready_url: str | None = None,
              health_url: str | None = None) -> None:
        now = self.clock()
        self.watched.append(Watched(name, process, ready_url, now, health_url,
                                    probe_at=now + self.liveness.period_s))

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
            if w.awaiting_ready:
                if self._ready(w):
                    w.awaiting_ready = False
                    w.probe_at = now + self.liveness.period_s
                    self.say(f"{w.name} is ready again, {now - w.exited_at:.1f}s after it exited")
                return
            if self._live(w, now):
                return
            code = w.process.stop()
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

    def _live(self, w: Watched, now: float) -> bool:
        """False once the server has failed its liveness probe `failures` times in a row."""
        if w.health_url is None or now < w.probe_at:
            return True
        w.probe_at = now + self.liveness.period_s
        try:
            answer = self._client().get(w.health_url, timeout=self.liveness.timeout_s)
            failure = None if answer.status_code == 200 else f"{answer.status_code} {answer.text[:200]}"
        except httpx.HTTPError as e:
            failure = f"{type(e).__name__}: {e}"
        w.failed_probes = 0 if failure is None else w.failed_probes + 1
        if failure is None or w.failed_probes < self.liveness.failures:
            return True
        w.failed_probes = 0
        self.say(f"{w.name} failed its liveness probe {self.liveness.failures} times in a row "
                 f"({failure}); stopping it")
        return False

    def _ready(self, w: Watched) -> bool:
        try:
            return self._client().get(w.ready_url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _client(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client()
        return self._http

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
        if self._http is not None and not (self._thread and self._thread.is_alive()):
            self._http.close()
            self._http = None
