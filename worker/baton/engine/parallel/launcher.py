"""Starting a group's rank processes as children of this one.

This is one of the two rooms that know how a rank process comes to exist: a leader asks a
launcher for `start(rank, command, env)` and gets a handle it can poll and stop. The other
is ray_launcher.py (Ray actors in a placement group, for `baton up`); everything else talks
to ranks through the control connection and the process group.

A local rank dies with its leader: it is started with PR_SET_PDEATHSIG. The kernel sends
that signal when the *thread* that started the child exits, so children are started from
one thread that lives as long as the launcher, never from a short-lived worker thread.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import queue
import signal
import subprocess
import threading

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
_STOP = object()


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (thread) goes away."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the leader's close() and the closed control connection still end it


def rank_cores(cores: list[int], size: int, rank: int) -> list[int]:
    """The CPU cores rank `rank` of `size` is pinned to, out of the worker's `cores`: an even
    share each, or one core shared round-robin when there are fewer cores than ranks
    (empty: no pinning)."""
    if not cores:
        return []
    if len(cores) < size:
        return [cores[rank % len(cores)]]
    base, extra = divmod(len(cores), size)
    start = rank * base + min(rank, extra)
    return list(cores[start : start + base + (1 if rank < extra else 0)])


class RankProcess:
    """A handle on one started rank."""

    def __init__(self, rank: int, proc: subprocess.Popen):
        self.rank, self.proc = rank, proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.proc.poll()

    def stop(self, grace_s: float = 2.0, timeout_s: float = 5.0) -> None:
        """Give it `grace_s` to end by itself (after a stop command), then terminate it
        (SIGKILL after `timeout_s` more)."""
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)


class LocalLauncher:
    """Starts ranks as child processes of this one, from a dedicated long-lived thread."""

    def __init__(self):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="baton-tp-launcher", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            item = self._requests.get()
            if item is _STOP:
                return
            future, command, env = item
            try:
                future.set_result(subprocess.Popen(command, env=env, preexec_fn=die_with_parent))
            except BaseException as exc:
                future.set_exception(exc)

    def start(self, rank: int, command: list[str], env: dict[str, str]) -> RankProcess:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._requests.put((future, command, env))
        return RankProcess(rank, future.result(timeout=60))

    def close(self) -> None:
        """Stop the starting thread (only once its children are gone: they die with it)."""
        self._requests.put(_STOP)
        self._thread.join(5)
