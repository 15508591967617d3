"""Item 1 of issue 15 on the router: stop limits at the API, a stop scan that stays linear."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_router_protocol import stream_through

from baton.engine.limits import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from baton.router.protocol import ApiError, parse_completion
from baton.router.textstream import TextAssembler


def rejection(body, model_info) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_completion({"prompt": "x", **body}, model_info)
    return err.value


@pytest.mark.parametrize("body,param,limit", [
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop", MAX_STOP_STRINGS),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop", MAX_STOP_STRING_CHARS),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", MAX_STOP_TOKEN_IDS),
])
def test_stop_limits_are_400s_naming_the_field_and_limit(body, param, limit, model_info):
    err = rejection(body, model_info)
    assert err.status == 400 and err.param == param and str(limit) in err.message


def test_stops_at_the_limits_are_accepted(model_info):
    req = parse_completion({"prompt": "x", "stop": ["y" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                            "stop_token_ids": [1] * MAX_STOP_TOKEN_IDS}, model_info)
    assert len(req.stop) == MAX_STOP_STRINGS and len(req.stop_token_ids) == MAX_STOP_TOKEN_IDS


def reference_text(tok, ids, stop) -> tuple[str, bool]:
    """The whole text, cut at the first stop string: what the assembler must hand out."""
    text = ""
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1])
        hits = [j for s in stop if (j := text.find(s)) >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


WORDS = [" the", " cat", " sat", " on", " a", " mat", "\n", " é", " 東京", "!", "STOP", "ST", "OP"]


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=25),
       stop=st.lists(st.sampled_from(["STOP", "mat\n", " a m", "at", "東", "cat sat on"]),
                     max_size=3))
def test_streamed_text_equals_the_cut_full_text(words, stop, model_info):
    tok = model_info.tokenizer
    ids = tok.encode("".join(words))
    expected, stopped = reference_text(tok, ids, stop)
    streamed, reason = stream_through(TextAssembler(tok, [], stop=stop, ignore_eos=True), ids)
    assert (streamed, reason == "stop") == (expected, stopped)


def run(tok, ids, n, stop) -> float:
    assembler = TextAssembler(tok, [], stop=stop, ignore_eos=True)
    started = time.perf_counter()
    for i in range(n):
        assembler.add(ids[i % len(ids)])
        assembler.take()
    assert len(assembler.unsent) + len(assembler.tail) <= 2 * MAX_STOP_STRING_CHARS  # state bounded
    return time.perf_counter() - started


def test_the_most_stop_strings_allowed_cost_a_bounded_amount_per_token(model_info):
    """16 stop strings of 256 characters that almost match cost little more than none: the
    scan looks at the new text and a bounded tail, never at the whole text."""
    tok = model_info.tokenizer
    ids = tok.encode(" zzzz" * 50)
    stops = ["z" * (MAX_STOP_STRING_CHARS - 1) + str(i % 10) for i in range(MAX_STOP_STRINGS)]
    n = 3000
    plain = min(run(tok, ids, n, []) for _ in range(2))
    worst = min(run(tok, ids, n, stops) for _ in range(2))
    assert worst < 20 * plain + 0.2, f"{worst:.3f} s with stops vs {plain:.3f} s without"


def test_a_vanishing_temperature_is_greedy(model_info):
    """Found by the abuse suite: 1e-155 overflowed the worker's logits (502 after retries)."""
    req = parse_completion({"prompt": "x", "temperature": 1.2538104876803428e-155}, model_info)
    assert req.temperature == 0.0
    assert parse_completion({"prompt": "x", "temperature": 0.5}, model_info).temperature == 0.5
