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
    reserved: int = 0  # KV reservations for prompts prefilling elsewhere: they will decode here
    kv_usage: float = 0.0
    inflight: int = 0  # requests this router has outstanding there (fresher than a poll)
    inflight_prompts: tuple[int, ...] = ()  # of which the prompt tokens still to prefill there, prompt by prompt
    chunk_size: int = 0  # its longest prompt chunk (0: whole prompts), from its state
    prefill_s_per_token: float | None = None  # its own measured cost of a prompt token
    inflight_at_poll: int = 0  # this router's outstanding requests there when it last polled

    @property
    def accepts_work(self) -> bool:
        return self.healthy and self.state == "active"

    @property
    def current(self) -> int:
        """Requests at work there now (running, waiting, or reserved for a prefill elsewhere),
        as well as the router knows: the last poll's count, moved by the requests this router
        has sent there (+) or seen end (-) since, and never below its own outstanding ones.
        The poll alone is stale between polls (a burst that came right after other work
        ended went six to two by it); the poll plus the router's own counted them twice."""
        polled = self.running + self.waiting + self.reserved
        return max(polled + self.inflight - self.inflight_at_poll, self.inflight, 0)


def rank_decode(workers: Iterable[WorkerSnapshot], exclude: set[str] = frozenset(),
                prompt_hashes: list[int] | None = None, index: PrefixIndex | None = None,
                prompt_tokens: int = 0, block_size: int = 0) -> list[WorkerSnapshot]:
    """Decode candidates, best first: room in the KV pool, then fewest requests at work,
    then the most free KV. Among the workers with room that run at most `affinity_slack`
    more requests than the least busy one, the one with the least prompt work ahead of this
    request's first token goes first: the prompt tokens this router sent there that are not
    prefilled yet (a colocated worker prefills them in turn, beside its decodes), plus the
    tokens of this prompt (`prompt_tokens`) it does not hold cached, by the prompt's block
    hashes and the index; then the longer cached prefix. So a burst of prompts spreads over
    workers that are equally loaded instead of queuing at the one that freed its slots, and
    a conversation's next turn finds its history where it left it. Without an index: by
    load alone."""
    eligible = [w for w in workers if w.accepts_work and w.role in DECODE_ROLES and w.url not in exclude]
    by_load = sorted(eligible, key=lambda w: (w.kv_usage >= KV_NEARLY_FULL, w.current, w.kv_usage, w.url))
    roomy = [w for w in by_load if w.kv_usage < KV_NEARLY_FULL]
    if index is None:  # by load alone
        return by_load
    cached = {w.url: index.cached_blocks(w.url, prompt_hashes) if prompt_hashes else 0 for w in roomy}
    if not any(cached.values()) and not any(w.inflight_prompts for w in roomy):
        return by_load
    least = min(w.current for w in roomy)
    near = {w.url for w in roomy if w.current <= least + affinity_slack(least)}

    def work_ahead(w: WorkerSnapshot) -> tuple[int, int]:
        if w.url not in near:
            return 0, 0
        uncached = max(prompt_tokens - cached[w.url] * block_size, 0)
        return sum(w.inflight_prompts) + uncached, -cached[w.url]

    return sorted(by_load, key=lambda w: (w.kv_usage >= KV_NEARLY_FULL, w.url not in near, work_ahead(w)))


def affinity_slack(least_busy: int) -> int:
    """How many more requests than the least busy worker a worker may run and still be
    chosen for its cached prefix: one, or a quarter of the least busy one's, so the
    workers' loads stay within about a quarter of each other."""
    return max(1, least_busy // 4)


def rank_prefill(workers: Iterable[WorkerSnapshot], prompt_hashes: list[int], index: PrefixIndex,
                 exclude: set[str] = frozenset()) -> list[WorkerSnapshot]:
    """Prefill candidates, best first: longest cached prefix of this prompt, then the
    shortest queue."""
    eligible = [w for w in workers if w.accepts_work and w.role in PREFILL_ROLES and w.url not in exclude]
    return sorted(eligible, key=lambda w: (-index.cached_blocks(w.url, prompt_hashes), w.current, w.url))


def prefill_queue_ahead(queued_prompts: Iterable[int], tokens: int, chunk_size: int = 0) -> int:
    """Prompt tokens a prompt of `tokens` can expect to wait for on a prefill worker that
    takes the prompt with the fewest tokens left first (engine/scheduler.py
    `shortest_first`): every queued prompt no longer than it, and of the longer ones only the
    step that may be under way (the shortest of them, one chunk of it where the worker
    chunks), half of it: a prompt arrives at no particular point of that step."""
    queued = list(queued_prompts)
    ahead = sum(t for t in queued if t <= tokens)
    longer = [t for t in queued if t > tokens]
    if longer:
        ahead += (min(min(longer), chunk_size) if chunk_size > 0 else min(longer)) // 2
    return ahead


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
