"""Shared fixtures: the bundled model in Baton's engine and in HF transformers (fp32, CPU)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# eight prompts of mixed lengths, including multi-byte text
PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land far away, there lived a wise old owl who",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "The capital of Germany is",
    "Explain photosynthesis in simple terms. Photosynthesis is the process by which green "
    "plants and some other organisms use sunlight to synthesize foods from carbon dioxide and",
    "Ünïcödé tëxt 東京 and emojis 🎉 are",
    "In 1492, Columbus",
]
NEW_TOKENS = 32


@contextlib.contextmanager
def _gguf_reads_cached():
    """transformers parses the GGUF with the gguf package once for the config, once for the
    weights and once for the tokenizer, and rebuilds gguf's tensor-name map for each of ~400
    modules: ~30 of the reference's ~45 s here. Both are deterministic reads of one file, so
    they are cached while the reference loads; what transformers does with them is unchanged."""
    import functools

    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


@pytest.fixture(scope="session")
def hf_reference():
    """HF transformers' greedy continuation of every prompt (the correctness reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from baton.engine.loader import bundled_model_path

    path = bundled_model_path()
    with _gguf_reads_cached():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    continuations = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
        continuations.append(out[0, ids.shape[1] :].tolist())
    return {"model": model, "tokenizer": tokenizer, "continuations": continuations}


def make_engine(**settings):
    """An engine on the bundled model; full precision unless asked (HF's reference is the
    dequantized model, computed in float32)."""
    from baton.engine import Engine

    defaults = dict(dtype="float32", quantization="none", kv_cache_memory_gb=0.25, threads=2)
    defaults.update(settings)
    return Engine(**defaults)


@pytest.fixture(scope="session")
def engine_fp32():
    return make_engine()
