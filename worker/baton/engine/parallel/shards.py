"""Which part of the model each tensor-parallel rank owns (pure: no torch, no I/O).

Query heads split evenly. KV heads split evenly while there are at least as many as ranks;
with more ranks than KV heads, each KV head is replicated on `size / num_kv_heads`
consecutive ranks, which works as long as each rank's query heads all read the same KV
head (SmolLM2's 9 query / 3 KV heads: 3 ranks of 3 query heads and 1 KV head each).
The MLP's intermediate columns and the vocabulary split as evenly as they can (any size).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """The half-open range [start, end)."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def scaled(self, factor: int) -> Span:
        """The same range in units `factor` times smaller (heads -> rows of head_dim each)."""
        return Span(self.start * factor, self.end * factor)

    def overlap(self, other: Span) -> Span | None:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Span(start, end) if start < end else None


@dataclass(frozen=True)
class RankShard:
    """Rank `rank` of `size`: the heads, intermediate columns and vocabulary rows it holds."""

    rank: int
    size: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span


def balanced_span(total: int, parts: int, index: int) -> Span:
    """Part `index` of `total` items cut into `parts` runs whose sizes differ by at most one
    (the first `total % parts` runs are one longer)."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} is outside [0, {parts})")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return Span(start, start + base + (1 if index < extra else 0))


def check_tensor_parallel(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Refuse a tensor-parallel size the model's heads cannot be split by, naming both."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {size}")
    if num_heads % size:
        raise ValueError(f"tensor-parallel size {size} does not divide the model's {num_heads} "
                         f"query heads")
    if num_heads % num_kv_heads:
        raise ValueError(f"the model's {num_heads} query heads are not a multiple of its "
                         f"{num_kv_heads} KV heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor-parallel size {size} neither divides the model's {num_kv_heads} "
                         f"KV heads nor is a multiple of them (each rank needs whole KV heads)")


def kv_head_span(num_kv_heads: int, size: int, rank: int) -> Span:
    """The KV heads rank `rank` of `size` holds (one replicated head when size > KV heads)."""
    if size <= num_kv_heads:
        per_rank = num_kv_heads // size
        return Span(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (size // num_kv_heads)
    return Span(head, head + 1)


def kv_head_owners(num_kv_heads: int, size: int) -> list[list[int]]:
    """For each KV head, the ranks holding it (more than one when it is replicated)."""
    owners: list[list[int]] = [[] for _ in range(num_kv_heads)]
    for rank in range(size):
        span = kv_head_span(num_kv_heads, size, rank)
        for head in range(span.start, span.end):
            owners[head].append(rank)
    return owners


def plan_shards(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                size: int) -> list[RankShard]:
    """Every rank's shard, after checking that `size` splits the model."""
    check_tensor_parallel(num_heads, num_kv_heads, size)
    if intermediate_size < size or vocab_size < size:
        raise ValueError(f"tensor-parallel size {size} exceeds the model's intermediate size "
                         f"{intermediate_size} or vocabulary {vocab_size}")
    q_per_rank = num_heads // size
    return [
        RankShard(
            rank=rank, size=size,
            q_heads=Span(rank * q_per_rank, (rank + 1) * q_per_rank),
            kv_heads=kv_head_span(num_kv_heads, size, rank),
            intermediate=balanced_span(intermediate_size, size, rank),
            vocab=balanced_span(vocab_size, size, rank),
        )
        for rank in range(size)
    ]


def shards_for(cfg, size: int) -> list[RankShard]:
    """plan_shards for a ModelConfig."""
    return plan_shards(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size, size)


def local_config(cfg, shard: RankShard):
    """The ModelConfig of one rank's slice: the same model with fewer heads, columns and rows
    (the model code runs unchanged on it)."""
    from dataclasses import replace

    return replace(cfg, num_heads=shard.q_heads.size, num_kv_heads=shard.kv_heads.size,
                   intermediate_size=shard.intermediate.size, vocab_size=shard.vocab.size)


def within(shard: RankShard, held: RankShard) -> RankShard:
    """`shard` counted from the start of `held`: where a rank that holds `held` finds the part
    it is to keep. ValueError, naming the first part that does not fit, when `held` lacks
    some of `shard` (a rank that must grow its slice loads it instead)."""
    spans = {}
    for part in ("q_heads", "kv_heads", "intermediate", "vocab"):
        want, have = getattr(shard, part), getattr(held, part)
        if want.start < have.start or want.end > have.end:
            raise ValueError(f"{part} {want.start}..{want.end} is not within the held {have.start}..{have.end}")
        spans[part] = Span(want.start - have.start, want.end - have.start)
    return RankShard(rank=shard.rank, size=shard.size, **spans)
