"""What a re-issued attempt asks the next worker for (pure)."""

from baton.router.dispatch import continuation_params

PARAMS = {"max_tokens": 32, "temperature": 0.8, "top_p": 0.95, "seed": 7, "ignore_eos": False}


def test_a_seeded_reissue_skips_the_draws_of_the_tokens_kept():
    assert continuation_params(PARAMS, 0) == PARAMS  # the first attempt: unchanged
    again = continuation_params(PARAMS, 5)
    assert again == {**PARAMS, "max_tokens": 27, "seed_offset": 5}
    assert continuation_params(again, 4) == {**PARAMS, "max_tokens": 23, "seed_offset": 9}
    assert PARAMS == {"max_tokens": 32, "temperature": 0.8, "top_p": 0.95, "seed": 7, "ignore_eos": False}


def test_an_unseeded_reissue_only_shortens():
    unseeded = {**PARAMS, "seed": None}
    assert continuation_params(unseeded, 5) == {**unseeded, "max_tokens": 27}
