"""Copy HF-named tensors into the engine's fused layout (qkv and gate_up in one matrix)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from baton.engine.models.llama import LlamaModel
from baton.engine.quant.weight import QuantizedTensor, QuantizedWeight

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# HF suffix -> (engine parameter, row slot in the fused matrix or None)
_LAYER_MAP = {
    "input_layernorm.weight": ("input_norm", None),
    "post_attention_layernorm.weight": ("post_attention_norm", None),
    "self_attn.q_proj.weight": ("qkv", 0),
    "self_attn.k_proj.weight": ("qkv", 1),
    "self_attn.v_proj.weight": ("qkv", 2),
    "self_attn.q_proj.bias": ("qkv_bias", 0),
    "self_attn.k_proj.bias": ("qkv_bias", 1),
    "self_attn.v_proj.bias": ("qkv_bias", 2),
    "self_attn.o_proj.weight": ("o_proj", None),
    "mlp.gate_proj.weight": ("gate_up", 0),
    "mlp.up_proj.weight": ("gate_up", 1),
    "mlp.down_proj.weight": ("down", None),
}
_IGNORED = ("rotary_emb.inv_freq",)


def load_weights(model: LlamaModel, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter of `model`; fail naming any tensor that is missing or misshapen."""
    cfg = model.cfg
    fused_rows = _fused_rows(cfg)
    filled: set[str] = set()
    quantized: dict[tuple[nn.Module, str], dict[int, QuantizedTensor]] = {}  # (owner, name) -> slot -> part
    for name, tensor in tensors:
        if name.endswith(_IGNORED):
            continue
        target, label = _resolve(model, name, fused_rows)
        if target is None:
            continue
        if target.shape != tensor.shape:
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        if isinstance(tensor, QuantizedTensor):
            owner, param_name, slot = _owner(model, name)
            quantized.setdefault((owner, param_name), {})[slot] = tensor
        else:
            target.copy_(tensor.to(target.dtype))
        filled.add(label)
    _check_complete(model, filled)
    for (owner, param_name), slots in quantized.items():
        _use_quantized(model, owner, param_name, slots)


def _fused_rows(cfg) -> dict[str, list[int]]:
    """Where each HF matrix's rows start and end in a fused one."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"qkv": [0, q, q + kv, q + 2 * kv], "qkv_bias": [0, q, q + kv, q + 2 * kv],
            "gate_up": [0, inter, 2 * inter]}


def _owner(model: LlamaModel, name: str) -> tuple[nn.Module, str, int]:
    """(module, parameter name, slot in a fused matrix) of a weight."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return model, "embed" if name == "model.embed_tokens.weight" else "lm_head", 0
    m = _LAYER_RE.fullmatch(name)
    param_name, slot = _LAYER_MAP[m.group(2)]
    return model.layers[int(m.group(1))], param_name, slot or 0


def _use_quantized(model: LlamaModel, owner: nn.Module, name: str, slots: dict[int, QuantizedTensor]) -> None:
    """Put a QuantizedWeight where the full-precision matrix was (which is dropped)."""
    expected = 3 if name == "qkv" else 2 if name == "gate_up" else 1
    if len(slots) != expected:
        raise ValueError(f"{name} mixes quantized and full-precision parts; "
                         "load the checkpoint with --quantization none")
    weight = QuantizedWeight([slots[i] for i in sorted(slots)])
    delattr(owner, name)
    setattr(owner, name, weight)
    if name == "embed" and model.cfg.tie_word_embeddings:  # the head is the embedding
        del model.lm_head
        model.lm_head = weight


def _resolve(model: LlamaModel, name: str, fused_rows: dict) -> tuple[torch.Tensor | None, str]:
    if name == "model.embed_tokens.weight":
        return model.embed.data, name
    if name == "model.norm.weight":
        return model.norm.data, name
    if name == "lm_head.weight":
        if model.cfg.tie_word_embeddings:
            return None, name  # tied: the embedding serves as the head
        return model.lm_head.data, name
    m = _LAYER_RE.fullmatch(name)
    if not m or m.group(2) not in _LAYER_MAP:
        raise ValueError(f"unexpected weight {name!r} for a Llama-family model")
    layer_index = int(m.group(1))
    if layer_index >= len(model.layers):
        raise ValueError(f"weight {name!r} names layer {layer_index}, model has {len(model.layers)}")
    param_name, slot = _LAYER_MAP[m.group(2)]
    param = getattr(model.layers[layer_index], param_name)
    if param is None:
        raise ValueError(f"weight {name!r} given but the config says the model has no such bias")
    if slot is None:
        return param.data, name
    rows = fused_rows[param_name]
    return param.data[rows[slot] : rows[slot + 1]], name


def _check_complete(model: LlamaModel, filled: set[str]) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not model.cfg.tie_word_embeddings:
        expected.add("lm_head.weight")
    for i, layer in enumerate(model.layers):
        for suffix, (param_name, _) in _LAYER_MAP.items():
            if getattr(layer, param_name) is not None:
                expected.add(f"model.layers.{i}.{suffix}")
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"weights file lacks {len(missing)} tensors, e.g. {missing[:3]}")


def model_tensors(model: LlamaModel) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The inverse of load_weights: the HF-named tensors `model` holds now (views of its
    dense parameters; quantized matrices as the checkpoint's blocks). A tensor-parallel rank
    that keeps part of its slice on a regroup loads its new slice from these."""
    cfg = model.cfg
    fused_rows = _fused_rows(cfg)
    yield "model.embed_tokens.weight", _whole(model.embed)
    yield "model.norm.weight", model.norm.data
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", _whole(model.lm_head)
    for i, layer in enumerate(model.layers):
        for suffix, (param_name, slot) in _LAYER_MAP.items():
            param = getattr(layer, param_name)
            if param is None:
                continue
            name = f"model.layers.{i}.{suffix}"
            if slot is None:
                yield name, _whole(param)
                continue
            first, end = fused_rows[param_name][slot : slot + 2]
            if isinstance(param, QuantizedWeight):
                yield name, param.checkpoint_rows(first, end - first)
            else:
                yield name, param.data[first:end]


def _whole(param) -> torch.Tensor | QuantizedTensor:
    if isinstance(param, QuantizedWeight):
        return param.checkpoint_rows(0, param.shape[0])
    return param.data
