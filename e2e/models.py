"""A model other than the bundled one, written by the test: tiny, random, and with a
tokenizer whose ids differ from SmolLM2's, so text decoded with the wrong tokenizer differs.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = 17  # SmolLM2's added tokens hold ids 0..16; they keep their ids


def shuffled_tokenizer(text: str, vocab_size: int) -> str:
    """tokenizer.json with every regular token's id reversed (pure): same strings, new ids."""
    data = json.loads(text)
    data["model"]["vocab"] = {token: (SPECIAL + vocab_size - 1 - i) if i >= SPECIAL else i
                              for token, i in data["model"]["vocab"].items()}
    return json.dumps(data)


def write_model(folder: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with SmolLM2's vocabulary, shuffled, as a HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from baton.engine.loader import load_source

    bundled = load_source(None).tokenizer
    vocab = bundled.vocab_size
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=bundled.bos_token_id, eos_token_id=bundled.eos_token_ids[0])
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(shuffled_tokenizer(bundled._tok.to_str(), vocab))
    return folder


def write_kquant_gguf(path: Path) -> Path:
    """The bundled model's first layers as a k-quant mix (Q2_K-Q6_K, IQ4_XS, Q5_0, Q5_1, IQ4_NL:
    what llama.cpp's Q2_K-Q5_K_M and IQ4_XS files hold), in one .gguf file."""
    from tests.engine.gguf_rewrite import rewrite_gguf
    from tests.engine.test_kquant_engine import LAYERS, MIX

    rewrite_gguf({path: MIX}, layers=LAYERS)
    return path
