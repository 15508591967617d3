"""Cut HF-named tensors down to one tensor-parallel rank's shard (pure tensor slicing).

Column-parallel Q/K/V and gate/up keep their rows for the rank's heads or columns;
row-parallel O and down keep the matching input columns (their partial outputs are summed
by an all-reduce); embedding and LM head keep the rank's vocabulary rows; norms are whole.
Each slice is copied, so the full tensor it came from can be freed as the load streams on.

A checkpoint's quantized matrix (QuantizedTensor) is cut the same way without
dequantizing: rows are whole rows of blocks, and a run of input columns is a run of whole
blocks (32 values each) when it starts and ends on a block edge. A column cut inside a
block (a head or intermediate split not a multiple of 32) cannot keep the blocks: that
matrix alone is dequantized and cut in float32.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from baton.engine.parallel.shards import RankShard, Span
from baton.engine.quant.formats import BLOCK, dequantize
from baton.engine.quant.weight import QuantizedTensor

_LAYER_RE = re.compile(r"model\.layers\.\d+\.(.+)")


def _rows(tensor, span: Span):
    if isinstance(tensor, QuantizedTensor):
        return QuantizedTensor(tensor.fmt, np.array(tensor.raw[span.start : span.end]), tensor.k)
    return tensor[span.start : span.end].clone()


def _columns(tensor, span: Span):
    if isinstance(tensor, QuantizedTensor):
        if span.start % BLOCK or span.end % BLOCK:
            return _columns(torch.from_numpy(dequantize(tensor.fmt, tensor.raw)), span)
        block = tensor.fmt.block_bytes
        raw = tensor.raw[:, span.start // BLOCK * block : span.end // BLOCK * block]
        return QuantizedTensor(tensor.fmt, np.array(raw), span.size)
    return tensor[:, span.start : span.end].contiguous().clone()


def shard_tensor(name: str, tensor, head_dim: int, shard: RankShard):
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


def keeps_blocks(shard: RankShard, head_dim: int) -> bool:
    """Whether every input-column cut of `shard` (O's per query head, down's per intermediate
    column) falls on a quantized block's edge, so its matrices kept their blocks."""
    cuts = (shard.q_heads.scaled(head_dim), shard.intermediate)
    return all(span.start % BLOCK == 0 and span.end % BLOCK == 0 for span in cuts)
