"""Block manager: reference counts, the prefix cache and LRU reuse of free cached blocks."""

from __future__ import annotations

import pytest

from baton.engine.block_manager import BlockManager, NoFreeBlocks, block_hashes, chain_hash
from baton.engine.sampling import SamplingParams
from baton.engine.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams())


def run_prompt(bm: BlockManager, s: Sequence) -> None:
    """Admit, 'compute' the whole prompt and register its full blocks, as a step would."""
    bm.match_prefix(s)
    bm.allocate(s, s.num_tokens)
    bm.record_admission(s)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)


def test_chain_hash_depends_on_everything_before():
    assert chain_hash(None, [1, 2]) == chain_hash(None, [1, 2])
    assert chain_hash(None, [1, 2]) != chain_hash(None, [2, 1])
    assert chain_hash(7, [1, 2]) != chain_hash(8, [1, 2])
    hashes = block_hashes(list(range(10)), 4)
    assert len(hashes) == 2  # the partial third block is not hashed
    assert hashes[1] == chain_hash(hashes[0], [4, 5, 6, 7])


def test_allocate_and_free_restore_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    run_prompt(bm, a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    bm.free_sequence(a)
    assert bm.num_free_blocks == 8 and all(c == 0 for c in bm.ref_counts)


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = seq(range(12), "a")
    run_prompt(bm, first)
    second = seq(range(12), "b")
    cached = bm.match_prefix(second)
    # 12 tokens = 3 full blocks, but the last token must be computed to sample from
    assert cached == 8
    assert second.block_table == first.block_table[:2]
    assert [bm.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    bm.allocate(second, 12)
    bm.record_admission(second)
    assert second.num_cached_tokens == 8
    assert (bm.prefix_queries, bm.prefix_hits) == (24, 8)


def test_freed_blocks_stay_cached_until_reused_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old = seq([1, 2, 3, 4, 5], "old")
    run_prompt(bm, old)  # blocks for [1,2] [3,4] [5]
    bm.free_sequence(old)
    revived = seq([1, 2, 3, 4, 9], "revived")
    assert bm.match_prefix(revived) == 4  # both full blocks come back from the free list
    bm.free_sequence(revived)
    # a request needing every block evicts the cached ones
    big = seq(range(100, 107), "big")
    bm.allocate(big, 7)
    assert bm.hash_to_block == {}
    with pytest.raises(NoFreeBlocks):
        bm.allocate(seq([0], "x"), 1)


def test_duplicate_content_keeps_one_cache_entry():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = seq([1, 2, 3], "a"), seq([1, 2, 3], "b")
    bm.allocate(a, 3)
    bm.allocate(b, 3)  # both computed privately at the same time
    for s in (a, b):
        s.num_computed_tokens = 3
        bm.register_full_blocks(s)
    assert bm.hash_to_block[chain_hash(None, [1, 2])] == a.block_table[0]
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert bm.num_free_blocks == 8


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    run_prompt(bm, seq([1, 2, 3, 4, 5], "a"))
    assert bm.match_prefix(seq([1, 2, 3, 4, 5], "b")) == 0
