"""Which prefill rank sends which KV heads to which decode rank (pure).

A prefill group of `source_size` ranks hands a prompt's KV to a decode group of
`target_size` ranks; the two split the model's KV heads differently (see shards.py). Every
decode rank must receive exactly the heads it owns, each head from one prefill rank that
holds it: one target may draw from several sources and one source may feed several
targets. Where the prefill group replicates a head (more ranks than KV heads), the copies
share the work: target t takes its heads from the holder at index t mod copies.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.parallel.shards import Span, kv_head_owners, kv_head_span


@dataclass(frozen=True)
class Route:
    """Model KV heads `heads` go from prefill rank `source` to decode rank `target`."""

    source: int
    target: int
    heads: Span


def reshard_plan(num_kv_heads: int, source_size: int, target_size: int) -> list[Route]:
    """The routes of one handoff, ordered by target and then by head."""
    for name, size in (("prefill", source_size), ("decode", target_size)):
        if size < 1 or (num_kv_heads % size and size % num_kv_heads):
            raise ValueError(f"{name} tensor-parallel size {size} cannot split {num_kv_heads} KV heads")
    owners = kv_head_owners(num_kv_heads, source_size)
    routes: list[Route] = []
    for target in range(target_size):
        span = kv_head_span(num_kv_heads, target_size, target)
        for head in range(span.start, span.end):
            holders = owners[head]
            source = holders[target % len(holders)]
            last = routes[-1] if routes else None
            if last is not None and last.target == target and last.source == source and last.heads.end == head:
                routes[-1] = Route(source, target, Span(last.heads.start, head + 1))
            else:
                routes.append(Route(source, target, Span(head, head + 1)))
    return routes
