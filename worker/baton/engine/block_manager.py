"""Paged KV block allocation with reference counts and a prefix cache.

Full blocks are keyed by a chained hash of their tokens (a block's hash covers every token
before it), so equal hashes mean equal prefixes. Free blocks keep their hash until they are
reused, in least-recently-freed order: a later request with the same prefix revives them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from baton.engine.sequence import Sequence


def chain_hash(prev_hash: int | None, tokens: list[int]) -> int:
    """Stable 64-bit hash of a full block given the hash of the block before it."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((prev_hash or 0).to_bytes(8, "little"))
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little")


def block_hashes(token_ids: list[int], block_size: int, prev: int | None = None) -> list[int]:
    """Chained hashes of every full block of a token list (what a router matches on); `prev`:
    the hash of the block before the list, where it continues a sequence."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = chain_hash(prev, token_ids[start : start + block_size])
        hashes.append(prev)
    return hashes


class NoFreeBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found

    # -- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- allocation -------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if not self.free:
            raise NoFreeBlocks("no free KV blocks")
        block_id, _ = self.free.popitem(last=False)  # least recently freed first
        old = self.block_hash[block_id]
        if old is not None and self.hash_to_block.get(old) == block_id:
            del self.hash_to_block[old]
        self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def _share(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a new sequence.

        At least one token is left uncomputed so the step that finishes the prompt has a
        position to sample from. Returns the number of cached tokens.
        """
        assert not seq.block_table, "match_prefix is for sequences holding no blocks"
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        prev = None
        for i in range(max_blocks):
            h = chain_hash(prev, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            self._share(block_id)
            seq.block_table.append(block_id)
            prev = h
        cached = len(seq.block_table) * self.block_size
        seq.num_hashed_blocks = len(seq.block_table)
        seq.last_block_hash = prev
        seq.num_computed_tokens = cached
        return cached

    def record_admission(self, seq: Sequence) -> None:
        """Count a newly admitted prompt in the prefix-cache statistics (once per request)."""
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens (all or nothing)."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self.free):
            raise NoFreeBlocks(f"need {needed} KV blocks, {len(self.free)} free")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enter blocks that became full of computed tokens into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_hashed_blocks, num_full):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            h = chain_hash(seq.last_block_hash, tokens)
            block_id = seq.block_table[i]
            # keep the first block registered for a hash; a duplicate stays private
            if h not in self.hash_to_block:
                self.hash_to_block[h] = block_id
                self.block_hash[block_id] = h
            seq.last_block_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def free_sequence(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks reaching zero become free (hashes kept)."""
        # tail first, so the prompt's leading blocks are evicted last
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.last_block_hash = None
