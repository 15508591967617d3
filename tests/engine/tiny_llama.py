"""A tiny random-weight Llama in a HF folder (config.json, model.safetensors,
tokenizer.json), written by the tests that need a model small enough to run many times."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=384, hidden_size=128,
    intermediate_size=192, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
    head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)


def _weights(cfg: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    # scaled so each product keeps its inputs' magnitude: logits far from ties
    rand = lambda *shape: torch.randn(*shape, generator=generator) / shape[-1] ** 0.5  # noqa: E731
    norm = lambda: 1 + 0.1 * torch.randn(h, generator=generator)  # noqa: E731
    tensors = {
        "model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=generator),
        "model.norm.weight": norm(),
        "lm_head.weight": 4 * rand(cfg["vocab_size"], h),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
    return tensors


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{n}": n for n in range(3, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def write_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    """Write the model into `folder` and return it (same seed, same weights)."""
    from safetensors.torch import save_file

    cfg = TINY_CONFIG | overrides
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    generator = torch.Generator().manual_seed(seed)
    save_file({k: v.contiguous() for k, v in _weights(cfg, generator).items()}, str(folder / "model.safetensors"))
    _tokenizer(cfg["vocab_size"]).save(str(folder / "tokenizer.json"))
    return folder
