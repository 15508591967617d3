"""A prefill worker's order (scheduler.py `shortest_first`): prompts by the tokens they have
left, fewest first, under way or waiting; past the first prompt a step takes others only
while its tokens stay within the admission cap."""

from __future__ import annotations

from baton.engine.block_manager import BlockManager
from baton.engine.sampling import SamplingParams
from baton.engine.scheduler import Scheduler
from baton.engine.sequence import Sequence
from tests.engine.test_scheduler import complete


def seq(n: int, rid: str) -> Sequence:
    """A prompt of n tokens no other prompt here shares (the prefix cache stays out of it)."""
    start = 1000 + 1000 * (sum(map(ord, rid)) % 97)
    return Sequence(rid, list(range(start, start + n)), SamplingParams())


def make(num_blocks=64, block_size=4, budget=64, chunk=16) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), 8, budget, chunk, shortest_first=True)


def step(sched: Scheduler, cap: int | None) -> list[tuple[str, int]]:
    """One step, run; prompts it finishes leave (handed off to a decode worker), their
    blocks in the prefix cache."""
    batch = sched.schedule(admission_cap=cap)
    complete(batch)
    for s, _ in batch.prefills:
        sched.blocks.register_full_blocks(s)
        if not s.in_prefill:
            sched.remove(s)
            sched.blocks.free_sequence(s)
    return [(s.request_id, n) for s, n in batch.prefills]


def test_a_short_prompt_runs_in_the_next_step_not_after_the_long_one_under_way():
    sched = make(chunk=16)
    sched.add(seq(64, "long"))
    assert step(sched, cap=4) == [("long", 16)]
    sched.add(seq(8, "short"))
    assert step(sched, cap=4) == [("short", 8)]  # alone: the cap is spent
    assert step(sched, cap=4) == [("long", 16)]
    sched.add(seq(2, "tiny"))
    assert step(sched, cap=4) == [("tiny", 2), ("long", 2)]  # the long one fills the cap's rest
    assert step(sched, cap=4) == [("long", 16)]
    assert step(sched, cap=4) == [("long", 14)]
    assert not sched.has_work()


def test_prompts_go_by_tokens_left_and_equal_ones_by_arrival():
    sched = make(chunk=0)  # whole prompts
    for rid, length in (("a", 12), ("b", 30), ("c", 12), ("d", 5)):
        sched.add(seq(length, rid))
    assert step(sched, cap=0) == [("d", 5)]
    assert step(sched, cap=0) == [("a", 12)]
    assert step(sched, cap=0) == [("c", 12)]
    assert step(sched, cap=0) == [("b", 30)]


def test_past_the_first_prompt_a_step_takes_only_what_shares_its_fixed_cost():
    sched = make(chunk=0)
    for rid, length in (("a", 40), ("b", 8), ("c", 8), ("d", 8)):
        sched.add(seq(length, rid))
    # b first whatever the cap; c beside it (16 tokens <= 20), d would pass the cap
    assert step(sched, cap=20) == [("b", 8), ("c", 8)]
    assert step(sched, cap=20) == [("d", 8)]  # a (40 tokens, whole prompts) would pass it
    assert step(sched, cap=20) == [("a", 40)]  # alone, however long
    unlimited = make(chunk=0)
    for rid, length in (("x", 20), ("y", 20)):
        unlimited.add(seq(length, rid))
    assert step(unlimited, cap=None) == [("x", 20), ("y", 20)]  # costs not measured yet


def test_two_long_prompts_run_one_after_the_other_not_side_by_side():
    sched = make(chunk=16)
    sched.add(seq(40, "first"))
    sched.add(seq(40, "second"))
    assert step(sched, cap=0) == [("first", 16)]
    assert step(sched, cap=0) == [("first", 16)]  # fewer left than the other
    assert step(sched, cap=0) == [("first", 8)]
    assert step(sched, cap=0) == [("second", 16)]


def test_a_short_prompt_without_kv_room_lets_the_one_under_way_go_on():
    sched = make(num_blocks=12, block_size=4, chunk=6)
    sched.add(seq(48, "long"))
    assert step(sched, cap=0) == [("long", 6)]  # 2 blocks, the second half full
    sched.blocks.allocate(seq(36, "elsewhere"), 36)  # 9 more held: 1 free
    sched.add(seq(12, "short"))  # fewer tokens left than the long one, but its chunk needs 2 blocks
    assert step(sched, cap=0) == [("long", 6)]  # its next chunk needs 1
    assert [s.request_id for s in sched.waiting] == ["short"]  # it keeps its place


def test_a_prompt_sharing_blocks_this_step_computes_waits_a_step_and_finds_them_cached():
    sched = make(block_size=4, chunk=0)
    system = list(range(500, 564))  # 64 shared tokens: 16 blocks
    first = Sequence("first", system + [1, 2], SamplingParams())
    second = Sequence("second", system + [3, 4, 5], SamplingParams())
    sched.add(first)
    sched.add(second)
    assert step(sched, cap=None) == [("first", 66)]  # second would compute the same blocks
    assert step(sched, cap=None) == [("second", 3)]  # found them cached (64 of its 67 tokens)
