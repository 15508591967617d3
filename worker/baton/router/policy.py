"""Routing decisions as pure functions: which path, which decode worker, which prefill
worker. No I/O: the pool hands in snapshots, the dispatcher acts on the answer."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from baton.engine.step_budget import UNREACHABLE_SHARE

DECODE_ROLES = ("decode", "both")
PREFILL_ROLES = ("prefill",)
KV_NEARLY_FULL = 0.95  # above this a worker is tried last: it will likely refuse
LONGEST_LOCAL_WAIT_FACTOR = 8.0  # where decodes leave a step next to nothing of their objective


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
    decodes_past_objective: bool = False  # its decodes alone outrun their TPOT objective (its state)
    tpot_objective_s: float | None = None  # the objective its decodes are paced to (its state; None: none)
    decode_step_line: tuple[float, float] | None = None  # its decode step: seconds at 0 decodes, per decode
    inflight_at_poll: int = 0  # this router's outstanding requests there when it last polled
    awaiting_remote: int = 0  # of this router's requests there, those whose prompts still prefill elsewhere

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


def prompts_done_within(queued_prompts: Iterable[int], seconds: float, s_per_token: float) -> int:
    """How many of a prefill worker's queued prompts (their tokens) it finishes within
    `seconds`, taking them fewest tokens first at `s_per_token`."""
    if s_per_token <= 0:
        return 0
    room, done = seconds / s_per_token, 0
    for tokens in sorted(queued_prompts):
        if tokens > room:
            break
        room -= tokens
        done += 1
    return done


RECENT_SENDS_WINDOW_S = 10.0  # how far back the rate of prompts sent to the prefill pool is counted


def prompts_held_up(recent_sends: Iterable[tuple[float, int]], now: float, tokens: int, wait_s: float,
                    prefill_workers: int = 1, chunk_size: int = 0, window_s: float = RECENT_SENDS_WINDOW_S) -> float:
    """The prompts a prompt of `tokens` sent to the prefill pool holds up there: those of at
    least its tokens (a prefill worker takes the fewest first) that reach its worker while it
    waits there (`wait_s`), at the rate such prompts were sent over the last `window_s`
    (`recent_sends`: when, and how many tokens to prefill), shared by `prefill_workers`. The
    queue found at the moment stood for them once: on a pair whose prefill worker cleared
    each 64-token prompt in ~0.1 s, two of them in flight together made short prompts count
    one held up, and a third of them prefilled beside eight streams, later than they would
    have come back from the prefill worker (bench/interference.py, C0, on a Zen 4 pair).
    None for a prompt longer than the worker's chunk (`chunk_size`): kept home, its chunks
    would attend over a growing context, which the decode worker's rate, measured on short
    chunks, does not price (a 2,000-token prompt counted as holding up the prompts queued
    there prefilled beside a decode worker's eight streams in 50-64 ms steps)."""
    if (chunk_size and tokens > chunk_size) or wait_s <= 0 or window_s <= 0:
        return 0.0
    sent = sum(1 for at, queued in recent_sends if now - at <= window_s and queued >= tokens)
    return sent / window_s * wait_s / max(prefill_workers, 1)


def decodes_stalled_by_local(decode: WorkerSnapshot, prefill_queue: Iterable[int], tokens: int,
                             local_s_per_token: float, prefill_s_per_token: float, chunk_size: int = 0) -> int:
    """The requests a local prefill of `tokens` on `decode` holds up: those at work there
    now, except this router's reservations whose prompts still wait on the prefill worker
    (its queue `prefill_queue`, prompt tokens each) and will not stream before the local
    prefill ends; those its prefill worker finishes within the local prefill's time do.
    Counting every reservation as a stream kept all 256-token prompts away from a decode
    worker running two or three streams, its other five or six requests queued on a
    prefill-bound worker (a Zen 4 core, bench/serving.py), though the local prefill would
    have stalled the three. A prompt longer than the prefill worker's chunk (`chunk_size`)
    counts every request there: its local time is not priced past a chunk (see
    prompts_held_up)."""
    if chunk_size and tokens > chunk_size:
        return decode.current
    awaiting = min(decode.awaiting_remote, decode.current)
    arriving = prompts_done_within(prefill_queue, tokens * local_s_per_token, prefill_s_per_token)
    return decode.current - awaiting + min(awaiting, arriving)


def local_wait_factor(decodes: int, tpot_objective_s: float | None,
                      decode_step_line: tuple[float, float] | None) -> float:
    """How many times its own compute a prompt waits to be prefilled on a decode worker with
    `decodes` streams. The worker's measured rate, t_local, is what prompt tokens add to a
    step; but beside decodes its chunks share steps held to the TPOT objective T with them
    (t_dec a step, from `decode_step_line`), so a step carries T - t_dec of prompt work and
    the prompt waits T / (T - t_dec) times its compute (at most LONGEST_LOCAL_WAIT_FACTOR).
    Where the decodes alone take T or more, a step adds half a decode step of prompt work:
    three times. 1 with no decodes (the prompt runs whole), no objective, or no steps seen.
    Priced at t_local alone, a 256-token prompt kept at a decode worker running three streams
    was expected in 0.14 s; that worker's steps carrying prompt tokens took 28 ms for ~28 of
    them beside 18 ms decode steps, ~9 steps or ~0.26 s for the prompt (a Xeon core,
    bench/serving.py)."""
    if decodes <= 0 or not tpot_objective_s or tpot_objective_s <= 0 or decode_step_line is None:
        return 1.0
    t_dec = decode_step_line[0] + decode_step_line[1] * decodes
    if t_dec >= tpot_objective_s:
        return 1.0 + 1.0 / UNREACHABLE_SHARE  # the budget's floor: half a decode step of prompt work
    return min(tpot_objective_s / (tpot_objective_s - t_dec), LONGEST_LOCAL_WAIT_FACTOR)


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
