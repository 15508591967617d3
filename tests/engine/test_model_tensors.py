"""A loaded model's tensors read back as the checkpoint held them, and a rank's new slice cut
from the slice it held: what a regrouped rank loads in place instead of the checkpoint."""

from __future__ import annotations

import pytest
import torch

from baton.engine.kernels import get_ops
from baton.engine.loader import load_source
from baton.engine.models.llama import LlamaModel
from baton.engine.native import build
from baton.engine.parallel.shards import Span, plan_shards, shards_for, within
from baton.engine.parallel.weight_shards import keeps_blocks, shard_tensor
from baton.engine.quant.formats import FORMATS
from baton.engine.quant.weight import QuantizedTensor, QuantizedWeight
from baton.engine.weights import load_weights, model_tensors
from tests.engine.quant_data import random_rows
from tests.engine.tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-tensors"))


def test_a_dense_model_gives_back_the_tensors_it_was_loaded_from(tiny):
    source = load_source(tiny)
    tensors = dict(source.tensors)
    model = LlamaModel(source.config, get_ops(torch.device("cpu")), torch.float32, max_positions=64)
    load_weights(model, tensors.items())
    back = dict(model_tensors(model))
    assert back.keys() == tensors.keys()  # the tiny model's head is its own (untied)
    for name, tensor in back.items():
        assert torch.equal(tensor, tensors[name].float()), name


@pytest.mark.parametrize("layout", ["gguf", "rows16"])
def test_a_quantized_matrix_gives_back_each_parts_checkpoint_rows(layout):
    """Q, K and V of one fused matrix in two formats (K and V merge into one part); the
    kernels' rearranged layout is undone bit for bit."""
    q4, q8 = FORMATS["Q4_1"], FORMATS["Q8_0"]
    parts = [QuantizedTensor(q4, random_rows(q4, 40, 64, seed=1), 64),
             QuantizedTensor(q8, random_rows(q8, 24, 64, seed=2), 64),
             QuantizedTensor(q8, random_rows(q8, 24, 64, seed=3), 64)]
    weight = QuantizedWeight(parts)
    if layout == "rows16":
        lib = build.load()
        if lib is None:
            pytest.skip(f"native library unavailable: {build.failure()}")
        weight.use_native(lib)
        assert weight.layout == "rows16"
    first = 0
    for part in parts:
        back = weight.checkpoint_rows(first, part.shape[0])
        assert back.fmt == part.fmt and back.k == part.k and (back.raw == part.raw).all()
        first += part.shape[0]
    with pytest.raises(IndexError, match="do not lie in one part"):
        weight.checkpoint_rows(30, 20)  # straddles the Q4_1 and Q8_0 parts


def test_a_new_slice_is_found_within_the_slice_that_holds_it(tiny):
    """Cutting a held slice at the relative spans gives what cutting the whole model at the
    absolute ones gives; a slice the held one lacks is refused by name."""
    source = load_source(tiny)
    cfg, tensors = source.config, dict(source.tensors)
    half, quarter = shards_for(cfg, 2), shards_for(cfg, 4)
    assert within(quarter[3], half[1]).q_heads == Span(half[1].q_heads.size // 2, half[1].q_heads.size)
    for new, held in ((quarter[0], half[0]), (quarter[3], half[1]), (half[0], shards_for(cfg, 1)[0])):
        relative = within(new, held)
        for name, tensor in tensors.items():
            held_part = shard_tensor(name, tensor, cfg.head_dim, held)
            assert torch.equal(shard_tensor(name, held_part, cfg.head_dim, relative),
                               shard_tensor(name, tensor, cfg.head_dim, new)), name
    with pytest.raises(ValueError, match=r"q_heads 0\.\.8 is not within the held 0\.\.4"):
        within(shards_for(cfg, 1)[0], half[0])
    with pytest.raises(ValueError, match="q_heads"):
        within(quarter[2], half[0])


def test_quantized_blocks_are_kept_only_where_every_column_cut_is_on_a_block_edge():
    aligned = plan_shards(6, 3, 192, 192, 3)  # 64 query columns, 64 intermediate each
    assert all(keeps_blocks(shard, 32) for shard in aligned)
    cut_inside = plan_shards(6, 3, 160, 192, 3)  # 160 intermediate columns: 54, 53, 53
    assert keeps_blocks(cut_inside[0], 32) is False
    assert keeps_blocks(plan_shards(6, 3, 160, 192, 1)[0], 32)  # one rank cuts nothing
