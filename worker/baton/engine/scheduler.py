"""Continuous batching: which tokens of which sequences run in the next step.

Each step has a token budget. Running decodes go first (one token each), then prefill
chunks: first sequences already part-way through their prompt, then waiting ones in
arrival order. When a decode needs a block and none is free, the most recently admitted
sequence is preempted: its blocks are freed and it goes back to the queue to be recomputed.

A prefill worker (`shortest_first`) has no decodes to keep in order and hands each prompt
off at the end of the step that finishes it, so it takes prompts by the tokens they have
left, fewest first (arrival order among equals), whether under way or waiting: a 64-token
prompt that arrives while a 2,000-token one is part-way through runs in the next step, not
beside or after the rest of it. Shortest-remaining-first is the order that minimizes the
mean time to first token; the router counts a prompt's wait the same way
(router/policy.py `prefill_queue_ahead`). Past the first prompt a step takes others only
while its tokens stay within `admission_cap` (engine.py: sharing the step's fixed cost, not
its work).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from baton.engine.block_manager import BlockManager, block_hashes
from baton.engine.sequence import Sequence, SequenceStatus

# A waiting prompt whose next uncached blocks another prompt of this step computes waits one
# step and finds them cached, where it shares at least this many tokens. Waiting costs it a
# step's fixed part F and saves it s per shared token: workers' calibrations on a Xeon core
# gave F 5-8 ms and s 0.07-0.28 ms, F/s 20-100. A constant, not each worker's measured F/s: a
# threshold that moves with step timings makes the same prompts schedule differently from run
# to run (two engines of a test, on the same prompts, once took 27 and 28 steps by it). Two
# 320-token prompts with one 256-token system prompt, sent together to a worker there, got
# their first tokens after ~320 ms in one step; a step apart, after ~130 and ~230 ms.
DEFER_SHARED_TOKENS = 64


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # sequences that outgrew the whole KV cache on their own: the engine ends them
    out_of_kv: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes or self.out_of_kv)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_size: int,
        shortest_first: bool = False,
    ):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size  # 0 = whole prompts
        self.shortest_first = shortest_first  # a prefill worker's order (module docstring)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in the cache (arrived from another worker)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the decision ----------------------------------------------------------------
    def schedule(self, prefill_cap: int | None = None, admission_cap: int | None = None) -> ScheduledBatch:
        """`prefill_cap`: at most this many prompt tokens next to the running decodes (the
        engine's TPOT budget); the step's own token budget applies in any case.
        `admission_cap` (`shortest_first` order only): at most this many prompt tokens in the
        step, the first prompt's whatever its length (a prefill worker's batch limit: every
        prompt the step finishes gets its first token at the step's end)."""
        batch = ScheduledBatch()
        budget = self._schedule_decodes(batch, self.max_num_batched_tokens)
        if prefill_cap is not None:
            budget = min(budget, prefill_cap)
        if self.shortest_first:
            self._schedule_shortest_first(batch, budget, admission_cap)
            return batch
        budget = self._schedule_running_prefills(batch, budget)
        self._admit_waiting(batch, budget)
        return batch

    def decoding(self) -> list[Sequence]:
        """Running sequences past their prompt: the decodes the next step will carry."""
        return [seq for seq in self.running if not seq.in_prefill]

    def num_decoding(self) -> int:
        return len(self.decoding())

    def _schedule_decodes(self, batch: ScheduledBatch, budget: int) -> int:
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running or seq.in_prefill:
                continue  # preempted meanwhile, or still prefilling
            if not self._make_room(seq, seq.num_tokens, batch):
                if len(self.running) == 1:
                    self.running.remove(seq)  # alone and still no room: it can never fit
                    batch.out_of_kv.append(seq)
                else:
                    self._preempt(seq, batch)  # nothing left to take from: recompute later
                continue
            self.blocks.allocate(seq, seq.num_tokens)
            batch.decodes.append(seq)
            budget -= 1
        return budget

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Preempt the newest other sequences until `seq` can hold `num_tokens` tokens."""
        scheduled_prefills = {id(s) for s, _ in batch.prefills}
        while self.blocks.blocks_needed(seq, num_tokens) > self.blocks.num_free_blocks:
            victims = [
                s for s in self.running if s is not seq and id(s) not in scheduled_prefills
            ]
            if not victims:
                return False
            self._preempt(victims[-1], batch)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        if seq in batch.decodes:
            batch.decodes.remove(seq)
        self.blocks.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _chunk(self, seq: Sequence, budget: int, first_prefill: bool) -> int:
        """How many of `seq`'s uncomputed tokens run this step (0 = not this step)."""
        remaining = seq.num_uncomputed_tokens
        if self.chunk_size == 0:
            # whole prompts: fits the budget, or is the only prefill (so it never starves)
            return remaining if remaining <= budget or first_prefill else 0
        return min(remaining, budget, self.chunk_size)

    def _schedule_running_prefills(self, batch: ScheduledBatch, budget: int) -> int:
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running or not seq.in_prefill:
                continue
            n = self._chunk(seq, budget, first_prefill=not batch.prefills)
            if n == 0 or not self._make_room(seq, seq.num_computed_tokens + n, batch):
                continue
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            batch.prefills.append((seq, n))
            budget -= n
        return budget

    def _schedule_shortest_first(self, batch: ScheduledBatch, budget: int, cap: int | None) -> None:
        """Prompts under way and waiting, fewest tokens left first; the first takes its chunk,
        the others what the budget and `cap` (the step's prompt tokens, the first's included)
        leave."""
        under_way = [seq for seq in self.running if seq.in_prefill]
        order = sorted(under_way + list(self.waiting), key=lambda seq: seq.num_uncomputed_tokens)  # stable
        used, admitting = 0, True
        for seq in order:
            room = budget if not batch.prefills or cap is None else min(budget, cap - used)
            if room <= 0:
                break
            if seq.status == SequenceStatus.RUNNING:
                n = self._chunk(seq, room, first_prefill=not batch.prefills)
                if n == 0 or seq not in self.running or not self._make_room(seq, seq.num_computed_tokens + n, batch):
                    continue
                self.blocks.allocate(seq, seq.num_computed_tokens + n)
                batch.prefills.append((seq, n))
            else:
                if not admitting or len(self.running) >= self.max_num_seqs:
                    continue
                if not seq.block_table:
                    self.blocks.match_prefix(seq)
                n = self._chunk(seq, room, first_prefill=not batch.prefills)
                deferred = bool(n and batch.prefills and self.blocks.enable_prefix_caching
                                and self._shared_tokens(seq, self._computing(batch)) >= DEFER_SHARED_TOKENS)
                if n == 0 or deferred or self.blocks.blocks_needed(
                        seq, seq.num_computed_tokens + n) > self.blocks.num_free_blocks:
                    # it keeps its place, its prefix blocks go back; without room, no later
                    # prompt jumps it; deferred, the next step finds its shared blocks cached
                    self.blocks.free_sequence(seq)
                    seq.num_computed_tokens = 0
                    admitting = admitting and deferred
                    continue
                self._admit(seq, n, batch)
            budget -= n
            used += n

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        computing: set[int] | None = None  # hashes of the full blocks this step's prompts compute
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.blocks.match_prefix(seq)
            n = self._chunk(seq, budget, first_prefill=not batch.prefills)
            if n and batch.prefills and self.blocks.enable_prefix_caching:
                if computing is None:
                    computing = self._computing(batch)
                if self._shared_tokens(seq, computing) >= DEFER_SHARED_TOKENS:
                    n = 0  # the next step finds them cached
            if n == 0 or self.blocks.blocks_needed(
                seq, seq.num_computed_tokens + n
            ) > self.blocks.num_free_blocks:
                # it keeps its place; its prefix blocks go back so they can be evicted
                self.blocks.free_sequence(seq)
                seq.num_computed_tokens = 0
                break
            self._admit(seq, n, batch)
            budget -= n
            if computing is not None:  # later prompts may share this one's blocks too
                computing.update(self._new_block_hashes(seq, n))

    def _admit(self, seq: Sequence, n: int, batch: ScheduledBatch) -> None:
        """A waiting prompt starts: its first `n` tokens in this batch."""
        self.blocks.allocate(seq, seq.num_computed_tokens + n)
        self.blocks.record_admission(seq)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.prefills.append((seq, n))

    def _computing(self, batch: ScheduledBatch) -> set[int]:
        """Hashes of the full blocks the batch's prompts compute."""
        return {h for s, k in batch.prefills for h in self._new_block_hashes(s, k)}

    def _new_block_hashes(self, seq: Sequence, tokens: int) -> list[int]:
        """Hashes of the full blocks `seq` completes with its next `tokens` tokens, the chain
        taken up from its last registered block (its computed or cached prefix is not hashed
        again: a sequence's registered blocks are all its computed full blocks)."""
        size = self.blocks.block_size
        start = seq.num_hashed_blocks * size
        return block_hashes(seq.token_ids[start : seq.num_computed_tokens + tokens], size, seq.last_block_hash)

    def _shared_tokens(self, seq: Sequence, computing: set[int]) -> int:
        """Tokens of `seq`'s next uncached full blocks (up to the last one it could take from
        the cache) that another prompt computes this step."""
        size = self.blocks.block_size
        last = (seq.num_tokens - 1) // size * size
        shared = 0
        for h in self._new_block_hashes(seq, last - seq.num_computed_tokens):
            if h not in computing:
                break
            shared += size
        return shared
