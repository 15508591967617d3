"""A Ray actor that owns one server process (a worker or the router).

The server runs as the actor's child with PR_SET_PDEATHSIG, so it dies with the actor even
if the actor is killed hard: stopping the actor can never leave an orphan server behind.
A child (rather than the actor's own threads) keeps each server's signal handling, CPU
affinity and torch threads exactly as `baton worker` sets them up.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: stop() still terminates the child


def server_command(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "baton.local.run_module", module, *args]


class ServerProcess:
    """Wrapped by `ray.remote` in runtime.py; usable without Ray in tests."""

    def __init__(self, module: str, args: list[str], env: dict[str, str], log_path: str | None = None):
        self.command = server_command(module, args)
        self.env = {**os.environ, **env}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def configure(self, module: str, args: list[str]) -> None:
        """Set the command once ports and peers are known (after every actor exists)."""
        self.command = server_command(module, args)

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def start(self) -> int:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        return self.proc.pid

    def pids(self) -> list[int]:
        """The actor's own pid and its server's."""
        return [os.getpid()] + ([self.proc.pid] if self.proc else [])

    def poll(self) -> int | None:
        """The server's exit code, or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def wait_exit(self) -> int | None:
        """Block until the server started last exits: its exit code (None if none started).
        Runs beside the other methods (the actor is threaded, runtime.py), so a supervisor
        learns of an exit from one pending call instead of a poll call every half second."""
        proc = self.proc
        return None if proc is None else proc.wait()

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)
