"""The leader's side of its ranks: their processes, command connections, replies, events.

One reader thread takes everything the ranks send: replies to calls (matched by call id,
so calls from several threads never take each other's answers), events (a rank's KV
transfers finishing, handed to `on_event`), and errors (a rank says why it stops). Sends
are serialised per connection; steps are sent without waiting for an answer, because the
step's collectives keep the ranks in lock step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from multiprocessing.connection import wait

log = logging.getLogger(__name__)
_WAIT_S = 0.2


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed; the message says which rank and why."""


class _Call:
    def __init__(self, ranks: set[int]):
        self.waiting = set(ranks)
        self.results: dict[int, object] = {}
        self.errors: dict[int, str] = {}
        self.done = threading.Event()


class RankGroup:
    def __init__(self, procs, conns: dict, on_event=None):
        self.procs = list(procs)
        self.conns = dict(conns)
        self.on_event = on_event  # fn(rank, event) on the reader thread
        self.errors: dict[int, str] = {}  # rank -> why it stopped (its own words, or EOF)
        self.ready: set[int] = set()
        self._send_locks = {rank: threading.Lock() for rank in self.conns}
        self._calls: dict[int, _Call] = {}
        self._calls_lock = threading.Lock()
        self._ids = itertools.count()
        self._changed = threading.Condition()
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="baton-tp-reader", daemon=True)
        self._reader.start()

    # -- sending -------------------------------------------------------------------------------
    def send(self, message, ranks=None) -> None:
        """Send to every rank (or `ranks`); OSError names the rank that cannot be reached."""
        for rank in sorted(self.conns) if ranks is None else ranks:
            try:
                with self._send_locks[rank]:
                    self.conns[rank].send(message)
            except OSError as exc:
                raise OSError(f"tensor-parallel rank {rank} cannot be reached: {exc}") from exc

    def call(self, name: str, *args, timeout_s: float, ranks=None) -> list:
        """Run `name(*args)` on every rank (or `ranks`); their results in rank order."""
        targets = sorted(self.conns) if ranks is None else list(ranks)
        if not targets:
            return []
        call_id = next(self._ids)
        pending = _Call(set(targets))
        with self._calls_lock:
            self._calls[call_id] = pending
        try:
            self.send(("call", call_id, name, args), targets)
            deadline = time.monotonic() + timeout_s
            while not pending.done.wait(_WAIT_S):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel ranks {sorted(pending.waiting)} did not answer "
                                       f"{name} within {timeout_s} s")
            if pending.errors:
                rank, text = min(pending.errors.items())
                raise RuntimeError(f"{name} failed on tensor-parallel rank {rank}: {text}")
            return [pending.results[rank] for rank in targets]
        finally:
            with self._calls_lock:
                self._calls.pop(call_id, None)

    def wait_ready(self, deadline: float) -> None:
        with self._changed:
            while self.ready != set(self.conns):
                self.check_alive()
                if time.monotonic() > deadline:
                    missing = sorted(set(self.conns) - self.ready)
                    raise TimeoutError(f"tensor-parallel ranks {missing} did not load their shards in time")
                self._changed.wait(_WAIT_S)

    # -- health --------------------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise, naming the rank, when one has reported an error, hung up or exited."""
        for rank, text in sorted(self.errors.items()):
            raise TensorParallelError(f"tensor-parallel rank {rank} failed: {text}")
        for proc in self.procs:
            code = proc.poll()
            if code is not None:
                raise TensorParallelError(f"tensor-parallel rank {proc.rank} exited with code {code}")

    def problem(self) -> str | None:
        """What check_alive would raise, without raising."""
        try:
            self.check_alive()
        except TensorParallelError as exc:
            return str(exc)
        return None

    def describe_failure(self, grace_s: float) -> str | None:
        """Within `grace_s`, the first thing that went wrong with a rank (or None)."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                self.check_alive()
            except TensorParallelError as exc:
                return str(exc)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    # -- the reader thread -----------------------------------------------------------------------
    def _read(self) -> None:
        by_conn = {conn: rank for rank, conn in self.conns.items()}
        open_conns = list(by_conn)
        while open_conns and not self._closing:
            try:
                ready = wait(open_conns, _WAIT_S)
            except OSError:
                return  # closed under us: the group is going away
            for conn in ready:
                rank = by_conn[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    open_conns.remove(conn)
                    if not self._closing:
                        self._record_error(rank, self._why_gone(rank))
                    continue
                self._dispatch(rank, message)

    def _why_gone(self, rank: int) -> str:
        """A rank hung up: its exit code if it ends within a moment (it usually has)."""
        proc = next((p for p in self.procs if p.rank == rank), None)
        deadline = time.monotonic() + 1.0
        while proc is not None and time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                return f"it exited with code {code}"
            time.sleep(0.02)
        return "it closed its connection"

    def _dispatch(self, rank: int, message) -> None:
        kind = message[0]
        if kind == "reply":
            _, call_id, ok, value = message
            with self._calls_lock:
                pending = self._calls.get(call_id)
            if pending is not None:
                (pending.results if ok else pending.errors)[rank] = value
                pending.waiting.discard(rank)
                if not pending.waiting:
                    pending.done.set()
        elif kind == "ready":
            with self._changed:
                self.ready.add(rank)
                self._changed.notify_all()
        elif kind == "event":
            if self.on_event is not None:
                try:
                    self.on_event(rank, message[1])
                except Exception:
                    log.exception("handling an event of tensor-parallel rank %d failed", rank)
        elif kind == "error":
            self._record_error(rank, message[1])
        else:
            log.warning("tensor-parallel rank %d sent an unknown message %r", rank, kind)

    def _record_error(self, rank: int, text: str) -> None:
        self.errors.setdefault(rank, text)
        with self._calls_lock:
            for pending in self._calls.values():
                if rank in pending.waiting:
                    pending.errors[rank] = text
                    pending.waiting.discard(rank)
                    if not pending.waiting:
                        pending.done.set()
        with self._changed:
            self._changed.notify_all()

    # -- stopping --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask every rank to stop, make sure each has, and close the connections."""
        self._closing = True
        for rank in sorted(self.conns):
            try:
                self.send(("stop",), [rank])
            except OSError:
                pass
        for proc in self.procs:
            proc.stop()
        for conn in self.conns.values():
            conn.close()
        self._reader.join(2)
