"""The worker's threads named for the OS, as Python names them.

Python 3.11 keeps a thread's name to itself: `top -H`, `ps -L`, py-spy's native frames and
/proc show every thread of a worker as `python`, so a profile of a busy worker cannot say
whether its engine, its KV receiver or its HTTP loop took the CPU. Linux lets a process
rename its own threads through /proc/self/task/<tid>/comm (15 bytes, no privilege needed).
"""

from __future__ import annotations

import threading
from pathlib import Path

COMM_BYTES = 15  # the kernel keeps at most this many bytes of a thread's name


def os_thread_name(name: str) -> str:
    """What the kernel would keep of `name`: ASCII, at most COMM_BYTES bytes."""
    return name.encode("ascii", "replace")[:COMM_BYTES].decode("ascii")


def name_os_threads(tasks: Path = Path("/proc/self/task")) -> dict[int, str]:
    """Give each live Python thread of this process but the main one its Python name at the
    OS level (the main thread's is the process's own, as `ps` shows it); returns {native id:
    name} for those renamed. Nothing happens where /proc cannot be written (not Linux, a
    read-only /proc): the names are for people looking on, never needed."""
    renamed = {}
    for thread in threading.enumerate():
        tid, name = thread.native_id, os_thread_name(thread.name)
        if tid is None or not name or thread is threading.main_thread():
            continue
        try:
            (tasks / str(tid) / "comm").write_text(name)
        except OSError:  # the thread ended meanwhile, or no /proc to write
            continue
        renamed[tid] = name
    return renamed
