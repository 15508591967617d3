"""A layer's wire payload as byte views of the cache blocks it lies in (no gather, no scatter).

The wire layout [2, tokens, heads, head_dim] is token-major, and so is a cache block
[block_size, heads, head_dim]. When a cache is on the CPU, contiguous, and the payload carries
all of its heads, the K half of a layer is simply the ticket's blocks laid end to end (the
last one cut at the prompt's end), and so is the V half. Blocks with consecutive ids are one
contiguous run of memory, so the payload is a short list of byte ranges: a sender can hand
them to sendmsg() and a receiver can recv straight into them.

Anything else (a GPU cache, a head shard, a strided cache) keeps the copy path
(layout.gather_layer / scatter_layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import crc32c
import torch

IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux's UIO_MAXIOV)


def block_runs(block_ids, block_size: int, num_tokens: int) -> tuple[tuple[int, int], ...]:
    """(first row, rows) of each run of consecutive blocks holding tokens [0, num_tokens),
    in token order, in a cache flattened to [num_blocks * block_size] rows."""
    used = -(-num_tokens // block_size) if num_tokens > 0 and block_size > 0 else 0
    # every layer of a request asks again: remember the answer (a ticket's ids are a tuple
    # of ints already, so they key the cache as they are)
    ids = block_ids[:used] if type(block_ids) is tuple else tuple(int(b) for b in block_ids[:used])
    return _block_runs(ids, block_size, num_tokens)


@lru_cache(maxsize=256)
def _block_runs(block_ids: tuple[int, ...], block_size: int, num_tokens: int) -> tuple[tuple[int, int], ...]:
    if num_tokens < 1 or block_size < 1:
        raise ValueError(f"block_runs: need num_tokens >= 1 and block_size >= 1, got {num_tokens}, {block_size}")
    used = -(-num_tokens // block_size)
    if used > len(block_ids):
        raise ValueError(
            f"block_ids: {len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens"
        )
    runs: list[list[int]] = []  # [first block, blocks]
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1][1] += 1
        else:
            runs.append([block, 1])
    rows = [[first * block_size, count * block_size] for first, count in runs]
    rows[-1][1] -= used * block_size - num_tokens  # the last block holds only the prompt's tail
    return tuple((start, count) for start, count in rows)


def cache_bytes(cache: torch.Tensor) -> memoryview | None:
    """Writable byte view of a whole CPU cache, or None when it is not one flat buffer."""
    if cache.device.type != "cpu" or not cache.is_contiguous() or cache.numel() == 0:
        return None
    return memoryview(cache.view(torch.uint8).numpy()).cast("B")


def supports_views(cache: torch.Tensor, block_size: int, head_start: int, head_end: int) -> bool:
    """True when whole-block byte views of `cache` carry the heads [head_start, head_end)."""
    return (
        cache.dim() == 4
        and cache.shape[1] == block_size
        and (head_start, head_end) == (0, cache.shape[2])
        and cache.device.type == "cpu"
        and cache.is_contiguous()
    )


def run_views(k_bytes: memoryview, v_bytes: memoryview, runs, row_nbytes: int) -> list[memoryview]:
    """The K runs then the V runs: a layer's payload in wire order, as slices (no copies)."""
    k = [k_bytes[start * row_nbytes : (start + count) * row_nbytes] for start, count in runs]
    v = [v_bytes[start * row_nbytes : (start + count) * row_nbytes] for start, count in runs]
    return k + v


def layer_views(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids, block_size: int,
                num_tokens: int, head_start: int, head_end: int,
                cache_byte_views: tuple[memoryview, memoryview] | None = None) -> list[memoryview] | None:
    """The layer's payload for tokens [0, num_tokens) as views of the caches, or None when
    the copy path must be used (see the module docstring). `cache_byte_views`: the caches'
    cache_bytes() made earlier, if the caller keeps them."""
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        return None
    if not supports_views(k_cache, block_size, head_start, head_end) or not v_cache.is_contiguous():
        return None
    k_bytes, v_bytes = cache_byte_views or (cache_bytes(k_cache), cache_bytes(v_cache))
    if k_bytes is None or v_bytes is None:
        return None
    runs = block_runs(block_ids, block_size, num_tokens)
    if (runs[-1][0] + runs[-1][1]) > k_cache.shape[0] * block_size or min(s for s, _ in runs) < 0:
        raise ValueError(f"block_ids: ids must lie in [0, {k_cache.shape[0]}), got {list(block_ids)}")
    row_nbytes = k_bytes.nbytes // (k_cache.shape[0] * block_size)
    return run_views(k_bytes, v_bytes, runs, row_nbytes)


def view_payload(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids, block_size: int,
                 num_tokens: int, head_start: int, head_end: int, shape: tuple[int, ...],
                 cache_byte_views: tuple[memoryview, memoryview] | None = None) -> ViewPayload | None:
    """The layer's payload of wire shape `shape` as a ViewPayload of the caches' blocks, or
    None when the copy path must be used (the blocks must stay unchanged while it is sent)."""
    views = layer_views(k_cache, v_cache, block_ids, block_size, num_tokens, head_start, head_end,
                        cache_byte_views)
    return None if views is None else ViewPayload(tuple(views), shape, k_cache.dtype)


def checksum_views(views, value: int = 0) -> int:
    """CRC32C of the views laid end to end (what one checksum of the joined bytes gives)."""
    for view in views:
        value = crc32c.crc32c(view, value=value)
    return value


@dataclass(frozen=True)
class ViewPayload:
    """A layer payload that lies in several byte ranges (block runs of a cache), in wire
    order. Stands in for the [2, tokens, heads, head_dim] tensor on the sender side."""

    views: tuple[memoryview, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        expected = math.prod(self.shape) * self.dtype.itemsize
        if self.nbytes != expected:
            raise ValueError(f"payload: views hold {self.nbytes} bytes, shape {self.shape} of {self.dtype} is {expected}")

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)

    def dim(self) -> int:
        return len(self.shape)

    def joined(self) -> bytes:
        """One copy of the bytes (fault injection in tests, shm segments)."""
        return b"".join(self.views)
