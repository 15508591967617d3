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


_GGUF_METADATA: dict = {}  # path -> transformers' parse of its metadata, kept between loads


@contextlib.contextmanager
def _gguf_reads_cached():
    """transformers parses the GGUF with the gguf package once for the config, once for the
    weights and once for the tokenizer, turns its metadata (the 49k-token vocabulary and its
    merges) into Python values for the config and again for the tokenizer, and rebuilds
    gguf's tensor-name map for each of ~400 modules: most of the reference's load time. All
    are deterministic reads of one file, so they are cached while the reference loads (a
    copy of the parsed metadata for each caller); what transformers does with them is
    unchanged."""
    import copy
    import functools

    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    reader, name_map, checkpoint = gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.load_gguf_checkpoint
    metadata = _GGUF_METADATA

    def metadata_cached(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:  # the weights: read once anyway
            return checkpoint(path, return_tensors, **kwargs)
        if path not in metadata:
            metadata[path] = checkpoint(path)
        return copy.deepcopy(metadata[path])

    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    gguf_utils.load_gguf_checkpoint = metadata_cached
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        gguf_utils.load_gguf_checkpoint = checkpoint


@pytest.fixture(scope="session")
def hf_tokenizer():
    """HF transformers' tokenizer of the bundled model, alone: tests that only save it beside
    a model of their own need not load the reference model (~8 s against ~13 s on 2 cores)."""
    from transformers import AutoTokenizer

    from baton.engine.loader import bundled_model_path

    path = bundled_model_path()
    with _gguf_reads_cached():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_reference(engine_fp32, hf_tokenizer):
    """HF transformers' greedy continuation of every prompt (the correctness reference)."""
    from transformers import AutoModelForCausalLM

    from baton.engine import SamplingParams
    from baton.engine.loader import bundled_model_path

    path = bundled_model_path()
    with _gguf_reads_cached():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    # a guess per prompt to check in one forward pass: Baton's own greedy tokens
    guesses = engine_fp32.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    continuations = [hf_greedy(model, hf_tokenizer(prompt).input_ids, guess.token_ids, NEW_TOKENS)
                     for prompt, guess in zip(PROMPTS, guesses, strict=True)]
    return {"model": model, "tokenizer": hf_tokenizer, "continuations": continuations}


def hf_greedy(model, ids: list[int], guess: list[int], count: int) -> list[int]:
    """HF's greedy continuation of `ids`, `count` tokens long. `guess` is checked first in
    one forward pass over ids + guess: the tokens up to the first position whose argmax
    differs are HF's own greedy choices, and HF generates the rest from its choice there
    (greedy decoding is that argmax, position after position). Much faster than
    `generate` token by token when the guess is right, the same answer when it is not."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids + guess[:count]])).logits[0]
    choices = logits[len(ids) - 1 : len(ids) - 1 + count].argmax(-1).tolist()
    agreed = next((i for i, (a, b) in enumerate(zip(choices, guess, strict=False)) if a != b),
                  min(len(choices), len(guess)))
    if agreed == count:
        return list(guess[:count])
    prefix = ids + choices[: agreed + 1]  # HF's own tokens: the agreed ones and its choice after
    left = count - agreed - 1
    if left == 0:
        return choices[: agreed + 1]
    out = model.generate(torch.tensor([prefix]), max_new_tokens=left, min_new_tokens=left, do_sample=False)
    return choices[: agreed + 1] + out[0, len(prefix):].tolist()


def make_engine(**settings):
    """An engine on the bundled model; full precision unless asked (HF's reference is the
    dequantized model, computed in float32)."""
    from baton.engine import Engine

    defaults = dict(dtype="float32", quantization="none", kv_cache_memory_gb=0.25, threads=2)
    defaults.update(settings)
    return Engine(**defaults)


@pytest.fixture(scope="module")
def small_pool_engine():
    """An engine with a KV pool of its own (16 blocks) for a module's tests that step it
    directly, shared by their cases."""
    return make_engine(num_kv_blocks=16)


@pytest.fixture(scope="session")
def engine_fp32():
    return make_engine()
