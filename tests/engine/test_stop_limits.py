"""Stop strings and stop token ids: limits on what a request may ask, and a stop search
whose cost per token does not grow with the text generated so far (pure, no model)."""

from __future__ import annotations

import pytest

from baton.engine import SamplingParams, stopping
from baton.engine.limits import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from baton.engine.sequence import Sequence
from baton.engine.stopping import StopChecker, find_stop


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1)), f"stop: at most {MAX_STOP_STRINGS} stop strings"),
        (SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), f"1 to {MAX_STOP_STRING_CHARS} characters"),
        (SamplingParams(stop=[""]), "each stop string must have 1 to"),
        (SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))),
         f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids"),
    ],
)
def test_stop_limits_name_the_field_and_the_limit(params, message):
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_stop_at_the_limits_is_accepted():
    p = SamplingParams(stop=["y" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                       stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    p.validate()
    single = SamplingParams(stop="end")
    single.validate()
    assert single.stop == ["end"]


def test_find_stop_sees_a_stop_string_across_the_tail_and_the_delta():
    assert find_stop("ab", "cd", ["bc"]) == 1
    assert find_stop("", "xxSTOP", ["STOP"]) == 2
    assert find_stop("ST", "OPxSTOP", ["STOP", "xS"]) == 0  # the earliest wins
    assert find_stop("abc", "def", ["zz"]) is None


class _Tok:
    """Just enough of a Tokenizer: token i decodes to the i-th character of the alphabet."""

    eos_token_ids = (0,)
    alphabet = "abcdefghijklmnopqrstuvwxyz "

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i % len(self.alphabet)] for i in ids)


def _checker(stop, prompt=(1, 2)):
    params = SamplingParams(max_tokens=10**9, stop=stop, ignore_eos=True)
    params.validate()
    seq = Sequence("r", list(prompt), params)
    return seq, StopChecker(_Tok(), seq, max_model_len=10**9)


def test_each_token_searches_only_a_bounded_window(monkeypatch):
    seen = []
    real = stopping.find_stop
    monkeypatch.setattr(stopping, "find_stop", lambda tail, delta, stops: seen.append(len(tail) + len(delta)) or real(tail, delta, stops))
    stops = ["q" * 40, "zzzz"]
    seq, checker = _checker(stops)
    for i in range(3000):
        token = 1 + i % 20  # b..u: never a stop
        seq.token_ids.append(token)
        delta, reason = checker.add(token)
        assert reason is None
    assert len(checker.text) > 2900 and len(seen) > 2900
    assert max(seen) <= 39 + 1  # longest stop - 1, plus the one new character


def test_a_stop_string_split_over_tokens_is_cut():
    seq, checker = _checker(["cde"])
    text = ""
    for token in (1, 2, 3, 4, 5):  # b c d e f
        seq.token_ids.append(token)
        delta, reason = checker.add(token)
        text += delta
        if reason:
            break
    assert reason == "stop" and checker.text == "b" and text == "bcd"  # "cd" had gone out already
