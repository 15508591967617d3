"""One container as a local process: its own mount namespace, the pod's address, a log file.

The child joins a new session (a process group to signal as a whole), dies with the node
agent (PR_SET_PDEATHSIG), and sees its volumes bind-mounted where the pod spec puts them.
Parents are mounted before children; a source must not lie under any mount target (the
mount would hide it), so the node keeps its folders outside /tmp (see e2e.cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
from collections.abc import Callable
from pathlib import Path

from .podspec import Mount, ProcessSpec

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1
CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def ordered(mounts: list[Mount]) -> list[Mount]:
    """Parents first; refuse a source that an earlier mount would hide (pure)."""
    out = sorted(mounts, key=lambda m: m.target.rstrip("/").count("/"))
    for mount in out:
        for other in out:
            if _under(mount.source, other.target):
                raise ValueError(f"mount source {mount.source} lies under mount target "
                                 f"{other.target}: keep node folders outside it")
    return out


def die_with_parent() -> None:
    """In a child between fork and exec: the kernel kills it when its parent dies."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _prepare(mounts: list[Mount], working_dir: str | None) -> Callable[[], None]:
    def run() -> None:  # in the child, between fork and exec
        die_with_parent()
        if mounts:
            _check(_libc.unshare(CLONE_NEWNS), "unshare")
            _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private /")
            for mount in ordered(mounts):
                target = mount.target.encode()
                if not os.path.exists(mount.target):
                    os.makedirs(mount.target)
                _check(_libc.mount(mount.source.encode(), target, None, MS_BIND | MS_REC, None),
                       f"bind {mount.target}")
                if mount.read_only:
                    _check(_libc.mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None),
                           f"read-only {mount.target}")
        if working_dir:
            os.chdir(working_dir)
    return run


class ContainerProcess:
    def __init__(self, spec: ProcessSpec, pod_ip: str, podnet: Path, flow_log: Path,
                 log_path: Path) -> None:
        self.spec, self.pod_ip = spec, pod_ip
        self.podnet, self.flow_log, self.log_path = podnet, flow_log, log_path
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        env = dict(self.spec.env)
        env.update(BATON_E2E_POD_IP=self.pod_ip, BATON_E2E_FLOW_LOG=str(self.flow_log),
                   LD_PRELOAD=str(self.podnet))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self.spec.argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                preexec_fn=_prepare(self.spec.mounts, self.spec.working_dir))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    async def stop(self, grace_seconds: float) -> int | None:
        """SIGTERM the container's process group, SIGKILL what is left after the grace period."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), max(grace_seconds, 0.1))
            except TimeoutError:
                self.signal(signal.SIGKILL)
                await self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers the main process left behind
        return self.proc.returncode
