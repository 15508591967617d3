"""Scheduling decisions: decodes first, chunked prefill under a budget, preemption."""

from __future__ import annotations

from baton.engine.block_manager import BlockManager
from baton.engine.sampling import SamplingParams
from baton.engine.scheduler import Scheduler
from baton.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, budget=16, chunk=8, max_seqs=8):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, max_seqs, budget, chunk)


def seq(n, rid):
    return Sequence(rid, list(range(1000, 1000 + n)), SamplingParams())


def complete(batch):
    """Pretend the step ran: computed tokens advance, finished prompts sample one token."""
    for s, n in batch.prefills:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(1)
    for s in batch.decodes:
        s.num_computed_tokens += 1
        s.token_ids.append(1)


def test_long_prompt_is_chunked_and_decodes_go_first():
    bm, sched = make(budget=10, chunk=8)
    short, long = seq(3, "short"), seq(20, "long")
    sched.add(short)
    sched.add(long)
    first = sched.schedule()
    assert [(s.request_id, n) for s, n in first.prefills] == [("short", 3), ("long", 7)]
    complete(first)
    second = sched.schedule()
    assert second.decodes == [short]
    assert [(s.request_id, n) for s, n in second.prefills] == [("long", 8)]
    assert second.num_tokens <= 10


def test_whole_prompt_mode_runs_a_long_prompt_alone():
    bm, sched = make(budget=8, chunk=0)
    long = seq(30, "long")
    sched.add(long)
    batch = sched.schedule()
    assert batch.prefills == [(long, 30)]  # over budget, but the only prefill: not starved
    sched.add(seq(5, "next"))
    complete(batch)
    batch = sched.schedule()
    assert batch.decodes == [long]
    assert [(s.request_id, n) for s, n in batch.prefills] == [("next", 5)]


def test_out_of_blocks_preempts_the_newest_sequence():
    bm, sched = make(num_blocks=4, block_size=4, budget=64, chunk=0)
    a, b = seq(8, "a"), seq(7, "b")  # a: 2 blocks, b: 2 blocks -> pool full
    sched.add(a)
    sched.add(b)
    complete(sched.schedule())
    assert bm.num_free_blocks == 0
    batch = sched.schedule()  # a's 9th token needs a third block
    assert batch.preempted == [b] and batch.decodes == [a]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.waiting[0] is b


def test_a_sequence_that_outgrows_the_whole_cache_is_ended():
    bm, sched = make(num_blocks=2, block_size=4, budget=64, chunk=0)
    a = seq(7, "a")
    sched.add(a)
    complete(sched.schedule())
    complete(sched.schedule())  # token 8 still fits in block 2
    batch = sched.schedule()  # token 9 needs a third block that does not exist
    assert batch.out_of_kv == [a]


def test_max_num_seqs_caps_the_running_batch():
    bm, sched = make(max_seqs=2, budget=64)
    for i in range(3):
        sched.add(seq(4, f"s{i}"))
    batch = sched.schedule()
    assert len(batch.prefills) == 2 and len(sched.waiting) == 1


def shared(prefix: int, suffix: int, rid: str, first_suffix_token: int) -> Sequence:
    tokens = list(range(1000, 1000 + prefix)) + list(range(first_suffix_token, first_suffix_token + suffix))
    return Sequence(rid, tokens, SamplingParams())


def registered(bm, batch):
    """`complete`, then enter the full blocks into the prefix cache, as the engine does."""
    complete(batch)
    for s, _ in batch.prefills:
        bm.register_full_blocks(s)


def test_prompts_sharing_a_long_prefix_wait_a_step_for_it_to_be_cached():
    bm, sched = make(num_blocks=256, block_size=16, budget=2048, chunk=0)
    a, b, c = (shared(256, 64, rid, 50_000 + 100 * i) for i, rid in enumerate("abc"))
    other = Sequence("other", list(range(70_000, 70_100)), SamplingParams())  # shares nothing: keeps its place
    for s in (a, b, c, other):
        sched.add(s)
    first = sched.schedule()
    assert [(s.request_id, n) for s, n in first.prefills] == [("a", 320)]
    assert b.block_table == [] and b.num_computed_tokens == 0  # its matched blocks went back
    registered(bm, first)
    second = sched.schedule()
    assert [(s.request_id, n) for s, n in second.prefills] == [("b", 64), ("c", 64), ("other", 100)]
    assert b.num_cached_tokens == c.num_cached_tokens == 256
    assert bm.prefix_hits == 512


def test_a_prompt_admitted_after_the_first_check_counts_for_the_ones_behind_it():
    bm, sched = make(num_blocks=256, block_size=16, budget=2048, chunk=0)
    lone = Sequence("lone", list(range(70_000, 70_100)), SamplingParams())
    x, y = shared(256, 64, "x", 50_000), shared(256, 64, "y", 60_000)
    for s in (lone, x, y):
        sched.add(s)
    first = sched.schedule()  # x is checked against lone's blocks; y against lone's and x's
    assert [(s.request_id, n) for s, n in first.prefills] == [("lone", 100), ("x", 320)]
    registered(bm, first)
    assert [(s.request_id, n) for s, n in sched.schedule().prefills] == [("y", 64)]


def test_prompts_sharing_a_block_or_two_run_together():
    bm, sched = make(num_blocks=256, block_size=16, budget=2048, chunk=0)
    a, b = shared(48, 64, "a", 50_000), shared(48, 64, "b", 60_000)  # 3 shared blocks: 48 tokens
    sched.add(a)
    sched.add(b)
    assert [(s.request_id, n) for s, n in sched.schedule().prefills] == [("a", 112), ("b", 112)]


def test_a_chunked_prompt_keeps_the_one_sharing_it_a_step_behind():
    bm, sched = make(num_blocks=256, block_size=16, budget=128, chunk=128)
    a, b = shared(384, 32, "a", 50_000), shared(384, 32, "b", 60_000)
    sched.add(a)
    sched.add(b)
    taken = []
    for _ in range(6):
        batch = sched.schedule()
        taken.append([(s.request_id, n) for s, n in batch.prefills])
        registered(bm, batch)
    # a computes 128 tokens a step; b never computes a block a computes in the same step
    assert taken[:4] == [[("a", 128)], [("a", 128)], [("a", 128)], [("a", 32), ("b", 32)]]
    assert b.num_cached_tokens == 384
