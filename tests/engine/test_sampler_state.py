"""A seeded request's random stream: the draw per token, its state as text, skipping ahead
(pure: no model)."""

from __future__ import annotations

import base64

import pytest
import torch

from baton.engine.sampler_state import FORMAT, export_state, restore_state
from baton.engine.sampling import (
    SamplingParams,
    _filter_logits,
    draw_inverse_cdf,
    draw_noise,
    sample,
    skip_draws,
)

VOCAB = 1000


def seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sampled_tokens(generator, logits_rows, params):
    return [sample(row[None], [params], [generator])[0].token_id for row in logits_rows]


def test_a_seeded_token_is_the_sample_torch_multinomial_draws():
    """Same tokens and the same generator state afterwards as before the draw was explicit:
    seeds keep giving the tokens they gave."""
    logits = torch.randn(20, VOCAB, generator=seeded(0)) * 3
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    ours, theirs = seeded(), seeded()
    for row in logits:
        token = sample(row[None], [params], [ours])[0].token_id
        probs = _filter_logits(row / 0.8, 0, 0.95).softmax(-1)
        assert token == int(torch.multinomial(probs, 1, generator=theirs))
    assert torch.equal(ours.get_state(), theirs.get_state())


def test_each_token_takes_one_fixed_draw_whatever_the_logits():
    sharp, flat = torch.full((VOCAB,), -30.0), torch.zeros(VOCAB)
    sharp[3] = 30.0
    params = SamplingParams(temperature=1.0, top_k=5, seed=1)
    a, b, c = seeded(), seeded(), seeded()
    sampled_tokens(a, [sharp, flat, sharp], params)
    sampled_tokens(b, [flat, flat, flat], params)
    skip_draws(c, 3, VOCAB)
    assert torch.equal(a.get_state(), b.get_state()) and torch.equal(a.get_state(), c.get_state())
    assert draw_noise(seeded(), VOCAB).dtype == torch.float32


def test_an_exported_state_continues_the_same_stream():
    logits = list(torch.randn(12, VOCAB, generator=seeded(2)) * 2)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    whole = sampled_tokens(seeded(5), logits, params)
    first = seeded(5)
    head = sampled_tokens(first, logits[:4], params)
    text = export_state(first)
    assert text.startswith(FORMAT + ":") and len(text) < 8000
    assert head + sampled_tokens(restore_state(text), logits[4:], params) == whole
    skipped = seeded(5)
    skip_draws(skipped, 4, VOCAB)  # what a re-issue re-derives without the state
    assert head + sampled_tokens(skipped, logits[4:], params) == whole
    assert export_state(None) is None


@pytest.mark.parametrize("text, problem", [
    (None, "expected a string"),
    ("x" * 100_000, "expected a string"),
    ("torch-cuda-philox/1:AAAA", "format"),
    ("no colon", "format"),
    (FORMAT + ":not base64!", "base64"),
    (FORMAT + ":" + base64.b64encode(b"\0" * 10).decode(), "10 state bytes"),
])
def test_a_state_that_cannot_continue_the_stream_is_refused(text, problem):
    with pytest.raises(ValueError, match=problem):
        restore_state(text)


def test_seed_offset_must_be_a_count():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="seed_offset"):
            SamplingParams(seed=1, seed_offset=bad).validate()
    SamplingParams(seed=1, seed_offset=3).validate()


def test_an_unseeded_token_follows_the_probabilities_and_is_never_a_zero_one():
    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    draws = [draw_inverse_cdf(probs) for _ in range(20000)]
    shares = {token: draws.count(token) / len(draws) for token in set(draws)}
    assert set(shares) == {1, 3, 4}
    assert shares[1] == pytest.approx(0.5, abs=0.02)
    assert shares[3] == pytest.approx(0.25, abs=0.02) and shares[4] == pytest.approx(0.25, abs=0.02)
    # all the mass at either end, and a total other than 1
    assert {draw_inverse_cdf(torch.tensor([0.0, 0.0, 3.0])) for _ in range(200)} == {2}
    assert {draw_inverse_cdf(torch.tensor([2.0, 0.0, 0.0])) for _ in range(200)} == {0}
    # probabilities that cannot be sampled (a NaN temperature, all masked) are refused by name
    for bad in (torch.tensor([0.5, float("nan")]), torch.zeros(3)):
        with pytest.raises(ValueError, match="cannot sample from probabilities"):
            draw_inverse_cdf(bad)
    # through sample(): a row with one token left after top-k always gives that token
    logits = torch.randn(VOCAB)
    top = int(logits.argmax())
    picks = {sample(logits[None], [SamplingParams(temperature=1.0, top_k=1)], [None])[0].token_id for _ in range(20)}
    assert picks == {top}
