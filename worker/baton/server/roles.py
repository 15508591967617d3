"""Role profiles and the worker's lifecycle states (pure).

A prefill worker wants a small KV pool (it holds a prompt only until the decode worker has
acknowledged it) and a big per-step token budget; a decode worker wants the opposite. A switch
keeps the memory budget: what the KV pool gives up, activations of the bigger steps take. Both
keep the chunk size: on a prefill worker it is the longest step a shorter prompt that arrives
waits for (it takes prompts fewest tokens first); whole-prompt steps there held 64-token
prompts for all of a 2,000-token one (~4 s on one core).
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.config import ROLES

ACTIVE, DRAINING, DRAINED, RESHARDING = "active", "draining", "drained", "resharding"
STATES = (ACTIVE, DRAINING, DRAINED, RESHARDING)

# KV pool and token budget are traded by this factor between the two roles.
PREFILL_FACTOR = 4


@dataclass(frozen=True)
class PoolShape:
    num_kv_blocks: int
    max_num_batched_tokens: int
    chunk_size: int  # 0 = whole prompts


def _as_decode(role: str, shape: PoolShape) -> PoolShape:
    """The decode-shaped pool equivalent to `shape` in role `role`."""
    if role == "prefill":
        return PoolShape(
            shape.num_kv_blocks * PREFILL_FACTOR,
            max(1, shape.max_num_batched_tokens // PREFILL_FACTOR),
            shape.chunk_size or 512,  # a whole-prompt prefill worker still chunks beside decodes
        )
    return shape


def shape_for_role(role: str, start_role: str, start_shape: PoolShape) -> PoolShape:
    """Pool shape for `role`, given the one the worker started with in `start_role`.

    Switching back to the starting role restores the starting shape exactly.
    """
    for name in (role, start_role):
        if name not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {name!r}")
    if role == start_role:
        return start_shape
    decode = _as_decode(start_role, start_shape)
    if role == "prefill":
        return PoolShape(
            max(1, decode.num_kv_blocks // PREFILL_FACTOR),
            decode.max_num_batched_tokens * PREFILL_FACTOR,
            decode.chunk_size,
        )
    return decode


def blocks_for_ranks(num_kv_blocks: int, kv_heads_before: int, kv_heads_after: int) -> int:
    """KV blocks per rank for a group whose ranks each hold `kv_heads_after` KV heads instead
    of `kv_heads_before`: the same KV memory per rank holds proportionally more or fewer."""
    if kv_heads_before < 1 or kv_heads_after < 1:
        raise ValueError("each rank holds at least one KV head")
    return max(1, num_kv_blocks * kv_heads_before // kv_heads_after)


def shape_for_ranks(shape: PoolShape, kv_heads_before: int, kv_heads_after: int) -> PoolShape:
    """`shape` for a group whose ranks hold `kv_heads_after` KV heads instead of `kv_heads_before`."""
    return PoolShape(blocks_for_ranks(shape.num_kv_blocks, kv_heads_before, kv_heads_after),
                     shape.max_num_batched_tokens, shape.chunk_size)


def accepts(role: str, work: str) -> bool:
    """Which roles take which work: `reserve` (decode side), `prefill`, `generate` (local)."""
    table = {
        "reserve": ("decode", "both"),
        "prefill": ("prefill", "both"),
        "generate": ("decode", "both"),
        "import": ("decode", "both"),
    }
    return role in table[work]
