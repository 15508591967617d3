"""The quantized weights side by side in one mapping the kernel may back with 2 MiB pages.

A decode step streams every weight once. Loaded matrix by matrix, SmolLM2's 121 matrices
(92 MB) lie in 4 KiB pages, about 23,000 of them a step, more than the core's TLB holds, so
most are a page walk. Copied into one private anonymous mapping advised for transparent
huge pages, they take about 50. On a Zen 4 core a decode step of 1 row took 0.95x the time,
of 8 rows 0.97x, a 256-token prompt the same (medians of 7 rounds, two engines taking turns:
bench/decode_pages.py). Where the kernel's setting is `never`, or the platform has no
madvise, the copy is skipped. The process's resident memory is also smaller: the copies'
sources go back to the system at once (release_freed_memory).
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np
import torch

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # each tensor starts on a cache line, as the kernels' loads expect
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(text: str) -> str:
    """The bracketed choice of the kernel's transparent huge page setting ("always
    [madvise] never" -> "madvise"), or "" where there is none."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return ""


def this_thp_mode() -> str:
    try:
        return thp_mode(THP_SETTING.read_text())
    except OSError:
        return ""


def aligned_offsets(sizes: list[int], alignment: int = ALIGNMENT) -> tuple[list[int], int]:
    """Where each of `sizes` bytes starts, side by side, each on `alignment`; and the bytes
    spanned."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // alignment) * alignment
    return offsets, end


def gather(tensors: list[torch.Tensor], setting: str = "") -> tuple[list[torch.Tensor], str]:
    """Copies of the contiguous CPU `tensors`, side by side in one mapping advised for huge
    pages and starting on one; or the tensors themselves where huge pages cannot be had or
    `setting` (BATON_WEIGHT_HUGE_PAGES) is "0". With how it went, for the log."""
    if setting.strip() == "0":
        return tensors, "weights in the allocator's pages (BATON_WEIGHT_HUGE_PAGES=0)"
    mode = this_thp_mode()
    if mode not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return tensors, f"weights in the allocator's pages (transparent huge pages: {mode or 'unavailable'})"
    offsets, total = aligned_offsets([t.nbytes for t in tensors])
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    region = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive while any view is
    start = -region.ctypes.data % HUGE_PAGE
    copies = []
    for tensor, offset in zip(tensors, offsets):
        flat = torch.from_numpy(region[start + offset: start + offset + tensor.nbytes])
        flat.copy_(tensor.contiguous().view(torch.uint8).reshape(-1))
        copies.append(flat.view(tensor.dtype).reshape(tensor.shape))
    return copies, f"weights in one {total / 2**20:.0f} MB mapping advised for 2 MiB pages ({mode})"


def release_freed_memory() -> None:
    """Hand the C heap's free memory back to the system (glibc's malloc_trim): the parts the
    copies replaced were freed into it, ~100 MB of SmolLM2's a process would go on holding."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
