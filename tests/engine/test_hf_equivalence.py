"""Greedy output equals HF transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest

from baton.engine import SamplingParams

from .conftest import NEW_TOKENS, PROMPTS, hf_greedy, make_engine

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def test_tokenizer_matches_hf(engine_fp32, hf_reference):
    hf_tok = hf_reference["tokenizer"]
    for text in [*PROMPTS, "  leading spaces\tand\ttabs\n\nnew lines 0123456789"]:
        assert engine_fp32.tokenizer.encode(text) == hf_tok(text).input_ids, text


def test_the_reference_is_hfs_own_whatever_the_guess(hf_reference):
    """The fixture checks a guess (Baton's tokens) in one HF forward pass; a wrong guess
    must still give HF's own greedy tokens, generated from where the guess went wrong."""
    model, tokenizer = hf_reference["model"], hf_reference["tokenizer"]
    reference = hf_reference["continuations"][0]
    ids = tokenizer(PROMPTS[0]).input_ids
    wrong = reference[:3] + [(t + 1) % 1000 for t in reference[3:]]
    assert hf_greedy(model, ids, wrong, NEW_TOKENS) == reference
    assert hf_greedy(model, ids, [], 4) == reference[:4]


@pytest.mark.parametrize("chunk_size", [0, 8])
def test_batch_of_mixed_lengths_matches_hf(hf_reference, chunk_size):
    # chunk 8 with a budget of 24 tokens forces chunked prefill mixed with decodes
    engine = make_engine(chunk_size=chunk_size, max_num_batched_tokens=24 if chunk_size else 2048)
    outputs = engine.generate(PROMPTS, GREEDY)
    for prompt, out, ref in zip(PROMPTS, outputs, hf_reference["continuations"]):
        assert out.token_ids == ref, prompt
        assert out.finish_reason == "length"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_prefix_cache_hit_gives_identical_tokens(hf_reference):
    engine = make_engine(block_size=4)
    long_prompt = PROMPTS[5]
    first = engine.generate([long_prompt], GREEDY)[0]
    second = engine.generate([long_prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    prompt_len = len(first.prompt_token_ids)
    # every full block but the one holding the last prompt token comes from the cache
    assert second.num_cached_tokens == (prompt_len - 1) // 4 * 4 > 0
    assert first.token_ids == second.token_ids == hf_reference["continuations"][5]


def test_shared_prefix_of_a_different_prompt(engine_fp32, hf_reference):
    base = PROMPTS[5]
    engine_fp32.generate([base], SamplingParams(max_tokens=1))
    extended = base + " water. The"
    out = engine_fp32.generate([extended], GREEDY)[0]
    assert out.num_cached_tokens >= 16
    hf_tok, model = hf_reference["tokenizer"], hf_reference["model"]
    ids = hf_tok(extended, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert out.token_ids == ref[0, ids.shape[1] :].tolist()


def test_preemption_by_recompute_keeps_output(hf_reference):
    # so few blocks that eight sequences cannot all hold their KV at once
    engine = make_engine(num_kv_blocks=24, block_size=4, chunk_size=0)
    outputs = engine.generate(PROMPTS, GREEDY)
    for out, ref in zip(outputs, hf_reference["continuations"]):
        assert out.token_ids == ref
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
