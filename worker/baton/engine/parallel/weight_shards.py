"""Cut HF-named tensors down to one tensor-parallel rank's shard (pure tensor slicing).

Column-parallel Q/K/V and gate/up keep their rows for the rank's heads or columns;
row-parallel O and down keep the matching input columns (their partial outputs are summed
by an all-reduce); embedding and LM head keep the rank's vocabulary rows; norms are whole.
Each slice is copied, so the full tensor it came from can be freed as the load streams on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from baton.engine.parallel.shards import RankShard, Span

_LAYER_RE = re.compile(r"model\.layers\.\d+\.(.+)")


def _rows(tensor: torch.Tensor, span: Span) -> torch.Tensor:
    return tensor[span.start : span.end].clone()


def _columns(tensor: torch.Tensor, span: Span) -> torch.Tensor:
    return tensor[:, span.start : span.end].contiguous().clone()


def shard_tensor(name: str, tensor: torch.Tensor, head_dim: int, shard: RankShard) -> torch.Tensor:
    """The part of HF tensor `name` that `shard` holds (a copy; norms are returned whole)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _rows(tensor, shard.vocab)
    m = _LAYER_RE.fullmatch(name)
    if m is None:
        return tensor
    suffix = m.group(1)
    if suffix.startswith("self_attn.q_proj."):
        return _rows(tensor, shard.q_heads.scaled(head_dim))
    if suffix.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return _rows(tensor, shard.kv_heads.scaled(head_dim))
    if suffix == "self_attn.o_proj.weight":
        return _columns(tensor, shard.q_heads.scaled(head_dim))
    if suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return _rows(tensor, shard.intermediate)
    if suffix == "mlp.down_proj.weight":
        return _columns(tensor, shard.intermediate)
    return tensor


def shard_tensors(tensors: Iterable[tuple[str, torch.Tensor]], head_dim: int,
                  shard: RankShard) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a model's tensors, each cut to `shard`."""
    for name, tensor in tensors:
        yield name, shard_tensor(name, tensor, head_dim, shard)
