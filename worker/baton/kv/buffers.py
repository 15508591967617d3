"""Reusable host buffers for outgoing layers.

A fresh multi-MB tensor per layer costs an allocation and a page fault per 4 KiB on first
touch, on the same core that gathers and sends. A sender keeps each layer until ACK (for
re-sends), so a transfer needs one buffer per layer; the pool hands the same, already
touched buffers to the next transfer of that size.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

DEFAULT_MAX_IDLE_BYTES = 1 << 30


class BufferPool:
    """Thread-safe: the compute thread acquires, the sender loop releases."""

    def __init__(self, max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES):
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._free: OrderedDict[int, list[torch.Tensor]] = OrderedDict()  # nbytes -> buffers
        self._idle_bytes = 0

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def acquire(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of `shape`/`dtype` with undefined contents."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        with self._lock:
            free = self._free.get(nbytes)
            raw = free.pop() if free else None
            if raw is not None:
                self._idle_bytes -= nbytes
                self._free.move_to_end(nbytes)
        if raw is None:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            raw.fill_(0)  # fault every page in once, here, not on each reuse
        return raw.view(dtype).view(shape)

    def release(self, tensor: torch.Tensor) -> None:
        """Give a buffer from acquire() back; the caller must hold no other view of it."""
        raw = tensor.view(-1).view(torch.uint8)
        nbytes = raw.numel()
        if nbytes == 0 or nbytes > self.max_idle_bytes:
            return
        with self._lock:
            # Make room by dropping buffers of the sizes used longest ago.
            while self._idle_bytes + nbytes > self.max_idle_bytes and self._free:
                size, bufs = next(iter(self._free.items()))
                if not bufs:
                    del self._free[size]
                    continue
                bufs.pop()
                self._idle_bytes -= size
            self._free.setdefault(nbytes, []).append(raw)
            self._free.move_to_end(nbytes)
            self._idle_bytes += nbytes


SEND_BUFFERS = BufferPool()
