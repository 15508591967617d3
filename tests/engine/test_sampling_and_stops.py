"""Sampling controls and stop conditions through the real engine."""

from __future__ import annotations

import torch

from baton.engine import SamplingParams
from baton.engine.sampling import greedy_tokens

PROMPT = "Write a short story about a robot:"


def test_same_seed_same_tokens_other_seed_other_tokens(engine_fp32):
    params = lambda seed: SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
    a, b, c = engine_fp32.generate([PROMPT] * 3, [params(1), params(1), params(2)])
    assert a.token_ids == b.token_ids  # batched together, still reproducible
    assert a.token_ids != c.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(engine_fp32):
    greedy = engine_fp32.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    for p in (SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, top_p=1e-6, seed=3, ignore_eos=True)):
        assert engine_fp32.generate([PROMPT], p)[0].token_ids == greedy.token_ids


def test_max_tokens_and_ignore_eos_give_fixed_lengths(engine_fp32):
    chat = engine_fp32.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    stopped = engine_fp32.generate([chat], SamplingParams(max_tokens=200))[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 200
    assert stopped.token_ids[-1] in engine_fp32.tokenizer.eos_token_ids
    fixed = engine_fp32.generate([chat], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert fixed.finish_reason == "length" and len(fixed.token_ids) == 40


def test_stop_strings_cut_the_text(engine_fp32):
    free = engine_fp32.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=20))[0]
    assert " 7," in free.text
    cut = engine_fp32.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=20, stop=[" 7"]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(" 7")]


def test_stop_token_ids(engine_fp32):
    free = engine_fp32.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12))[0]
    stop_id = free.token_ids[3]
    cut = engine_fp32.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]


def test_logprobs(engine_fp32):
    out = engine_fp32.generate([PROMPT], SamplingParams(max_tokens=5, logprobs=3))[0]
    assert len(out.logprobs) == 5
    for entry, token in zip(out.logprobs, out.token_ids):
        assert entry["token_id"] == token and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3
        # greedy: the chosen token is the most likely one
        assert max(entry["top_logprobs"].values()) == entry["logprob"]


def test_chat_template_answers_paris(engine_fp32):
    prompt = engine_fp32.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    out = engine_fp32.generate([prompt], SamplingParams(max_tokens=48))[0]
    assert "Paris" in out.text


def test_token_id_prompts_equal_text_prompts(engine_fp32):
    ids = engine_fp32.tokenizer.encode(PROMPT)
    a, b = engine_fp32.generate([PROMPT, ids], SamplingParams(max_tokens=8))
    assert a.token_ids == b.token_ids and a.text == b.text


def test_greedy_tokens_match_argmax_ties_and_nan_included():
    """The greedy pick (max over the vocabulary, faster than argmax on a CPU) is argmax's:
    the first of tied maxima, a NaN as the highest, and any random row."""
    scores = torch.zeros(4, 1000)
    scores[1, 10] = scores[1, 900] = 3.0  # a tie: the first one
    scores[2, 7] = float("nan")  # NaN wins, as in argmax
    scores[3] = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert greedy_tokens(scores) == scores.argmax(-1).tolist()
    assert greedy_tokens(scores)[:3] == [0, 10, 7]
