"""Routing decisions as pure functions: which path, which decode worker, which prefill
worker. No I/O: the pool hands in snapshots, the dispatcher acts on the answer."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

DECODE_ROLES = ("decode", "both")
PREFILL_ROLES = ("prefill",)
KV_NEARLY_FULL = 0.95  # above this a worker is tried last: it will likely refuse


@dataclass(frozen=True)
class WorkerSnapshot:
    """What the router believes about one worker right now."""

    url: str
    role: str  # prefill | decode | both
    state: str = "active"  # active | draining | resharding | drained
    healthy: bool = True  # answered its last state poll
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    inflight: int = 0  # requests this router has outstanding there (fresher than a poll)
    inflight_tokens: int = 0  # of which prompt tokens still to prefill (prefill workers)
    prefill_s_per_token: float | None = None  # its own measured cost of a prompt token

    @property
    def accepts_work(self) -> bool:
        return self.healthy and self.state == "active"

    @property
    def load(self) -> int:
        return max(self.running + self.waiting, 0) + self.inflight

    @property
    def busy(self) -> int:
        """Requests at work there: the last poll's count, or this router's own outstanding
        ones when they are more (the poll may be older than they are)."""
        return max(self.running + self.waiting, self.inflight, 0)


def rank_decode(workers: Iterable[WorkerSnapshot], exclude: set[str] = frozenset()) -> list[WorkerSnapshot]:
    """Decode candidates, best first: room in the KV pool, then fewest running requests,
    then the most free KV."""
    eligible = [w for w in workers if w.accepts_work and w.role in DECODE_ROLES and w.url not in exclude]
    return sorted(eligible, key=lambda w: (w.kv_usage >= KV_NEARLY_FULL, w.load, w.kv_usage, w.url))


def rank_prefill(workers: Iterable[WorkerSnapshot], prompt_hashes: list[int], index: PrefixIndex,
                 exclude: set[str] = frozenset()) -> list[WorkerSnapshot]:
    """Prefill candidates, best first: longest cached prefix of this prompt, then the
    shortest queue."""
    eligible = [w for w in workers if w.accepts_work and w.role in PREFILL_ROLES and w.url not in exclude]
    return sorted(eligible, key=lambda w: (-index.cached_blocks(w.url, prompt_hashes), w.load, w.url))


def choose_path(uncached_tokens: int, threshold: float, has_prefill_worker: bool) -> str:
    """Conditional disaggregation: a short uncached prompt is prefilled where it decodes."""
    if not has_prefill_worker or uncached_tokens < threshold:
        return "local"
    return "remote"


class PrefixIndex:
    """Approximate per-worker LRU of the block hashes this router sent to each worker.

    Block hashes are chained, so a prompt's cached prefix is the longest run of its leading
    hashes found here. Approximate: the worker may have evicted them since.
    """

    def __init__(self, capacity_blocks: int = 8192):
        self.capacity = capacity_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def record(self, worker: str, hashes: list[int]) -> None:
        lru = self._lru.setdefault(worker, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def cached_blocks(self, worker: str, hashes: list[int]) -> int:
        lru = self._lru.get(worker)
        if not lru:
            return 0
        count = 0
        for h in hashes:
            if h not in lru:
                break
            count += 1
        return count

    def forget(self, worker: str) -> None:
        self._lru.pop(worker, None)
