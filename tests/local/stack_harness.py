"""Run `baton up` as a real subprocess and find everything it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

URL_LINE = re.compile(r"Baton is up: (http://\S+)/v1")


class UpProcess:
    def __init__(self, args: list[str], log_dir: Path, env: dict[str, str] | None = None):
        self.log_dir = log_dir
        self.out_path = log_dir / "baton-up.out"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli", "up", *args, "--log-dir", str(log_dir)],
            stdout=open(self.out_path, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True, env={**os.environ, **(env or {})})
        self.url = ""

    def wait_up(self, timeout_s: float = 240.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = URL_LINE.search(self.out_path.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"baton up did not come up:\n{self.output()}")

    def output(self) -> str:
        logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                       for p in sorted(self.log_dir.glob("*.log")))
        return self.out_path.read_text(errors="replace")[-4000:] + logs

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def server(self, *markers: str) -> psutil.Process:
        """The one running server process whose command line holds every marker, e.g.
        ("baton.server.main", "--role decode") or ("baton.router.main",)."""
        found = []
        for p in self.descendants():
            try:
                line = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "baton.local.run_module" in line and all(m in line for m in markers):
                found.append(p)
        assert len(found) == 1, f"{len(found)} processes match {markers}"
        return found[0]

    def printed(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_printed(self, text: str, timeout_s: float, count: int = 1) -> float:
        """Seconds until `baton up` has printed `text` `count` times (fails past the timeout)."""
        started = time.monotonic()
        while self.printed().count(text) < count:
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"baton up did not print {text!r} x{count} within {timeout_s}s:\n"
                                     f"{self.output()}")
            time.sleep(0.2)
        return time.monotonic() - started

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session only
            self.proc.wait(10)
            raise AssertionError(f"baton up ignored the signal:\n{self.output()}") from None


def alive(processes: list[psutil.Process]) -> list[str]:
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def assert_all_exit(processes: list[psutil.Process], within_s: float = 30.0) -> None:
    """Every one of `processes` is gone within `within_s`: `baton up` leaves nothing behind."""
    deadline = time.monotonic() + within_s
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(processes) == [], "processes left behind"
