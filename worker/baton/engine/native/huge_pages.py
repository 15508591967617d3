"""The quantized weights side by side in one mapping the kernel may back with 2 MiB pages.

A decode step streams every weight once. Loaded matrix by matrix, SmolLM2's 121 matrices
(92 MB) lie mostly in 4 KiB pages (numpy advises huge pages itself only for arrays of 4 MB
or more: here the 30 MB embedding alone), ~15,000 of them a step, more than the core's TLB
holds, so most are a page walk. Copied into one private anonymous mapping advised for
transparent huge pages, they take about 50. On a Zen 4 core a decode step of 1 row took 0.95-0.96x the
time, of 8 rows 0.97-0.98x, a 256-token prompt the same (medians of 7 rounds, two engines
taking turns, two runs: bench/decode_pages.py). Where the kernel's setting is `never`, or
the platform has no madvise, the copy is skipped. The process's resident memory is also
smaller: the copies' sources go back to the system at once (release_freed_memory).

The KV cache was tried the same way, in a mapping of its own: no difference measured, with
the weights in huge pages or without (decode steps 0.97-1.07x; bench/results/huge_pages_zen4/).

BATON_HUGE_PAGES=0 keeps the weights in the allocator's pages.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import torch

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # each tensor starts on a cache line, as the kernels' loads expect
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SETTING = "BATON_HUGE_PAGES"


def parse_setting(text: str) -> bool:
    """Whether BATON_HUGE_PAGES asks for huge pages: unset, "" or "1" yes, "0" no;
    ValueError naming the variable for anything else."""
    text = text.strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{SETTING} must be 1 or 0, got {text!r}")
    return text != "0"


def wanted() -> bool:
    """Whether this process's setting asks for huge pages."""
    return parse_setting(os.environ.get(SETTING, ""))


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


def gather(tensors: list[torch.Tensor], enabled: bool = True) -> tuple[list[torch.Tensor], str]:
    """Copies of the contiguous CPU `tensors`, side by side in one mapping advised for huge
    pages and starting on one; or the tensors themselves where huge pages cannot be had or
    are not `enabled`. With how it went, for the log."""
    if not enabled:
        return tensors, f"weights in the allocator's pages ({SETTING}=0)"
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
    return copies, f"weights in one mapping advised for 2 MiB pages ({mode})"


def release_freed_memory() -> None:
    """Hand the C heap's free memory back to the system (glibc's malloc_trim): the parts the
    copies replaced were freed into it, ~100 MB of SmolLM2's a process would go on holding."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
