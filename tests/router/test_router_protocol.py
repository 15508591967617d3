"""OpenAI request validation and the text assembler (tokenizer only, no servers)."""

from __future__ import annotations

import pytest

from baton.engine.tokenizer import IncrementalDetokenizer
from baton.router.protocol import ApiError, parse_chat, parse_completion
from baton.router.textstream import TextAssembler
from baton.router.worker_client import DONE, parse_sse_line


def status_of(fn, body, model_info) -> int:
    with pytest.raises(ApiError) as err:
        fn(body, model_info)
    assert set(err.value.body()["error"]) >= {"message", "type", "param", "code"}
    return err.value.status


def test_completion_defaults_and_token_prompts(model_info):
    req = parse_completion({"model": "smollm2", "prompt": "Hello"}, model_info)
    assert req.max_tokens == 16 and req.prompt_ids == model_info.tokenizer.encode("Hello")
    req = parse_completion({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0,
                            "ignore_eos": True, "stop": "x", "seed": 7}, model_info)
    assert req.prompt_ids == [1, 2, 3] and req.ignore_eos and req.stop == ["x"]
    params = req.worker_params()
    assert params["max_tokens"] == 4 and params["temperature"] == 0 and params["seed"] == 7


def test_chat_uses_the_template_and_fills_max_tokens(model_info):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    req = parse_chat({"model": "smollm2", "messages": messages}, model_info)
    text = model_info.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert req.prompt_ids == model_info.tokenizer.encode(text)
    assert req.max_tokens == model_info.max_model_len - len(req.prompt_ids)
    assert parse_chat({"messages": messages, "max_completion_tokens": 5}, model_info).max_tokens == 5


@pytest.mark.parametrize("body,status", [
    ({"model": "gpt-4", "prompt": "x"}, 404),
    ({"prompt": "x", "max_tokens": -1}, 400),
    ({"prompt": "x", "max_tokens": 0}, 400),
    ({"prompt": "x", "max_tokens": 10**9}, 400),
    ({"prompt": "x", "n": 2}, 400),
    ({"prompt": "x", "best_of": 3}, 400),
    ({"prompt": "x", "temperature": -1}, 400),
    ({"prompt": "x", "top_p": 0}, 400),
    ({"prompt": "", "max_tokens": 1}, 400),
    ({"prompt": [10**9]}, 400),
    ({"prompt": ["a", "b"]}, 400),
    ({"max_tokens": 3}, 400),
    ([1, 2], 400),
])
def test_completion_rejections(body, status, model_info):
    assert status_of(parse_completion, body, model_info) == status


def test_prompt_over_context_is_rejected(model_info):
    ids = [100] * model_info.max_model_len
    assert status_of(parse_completion, {"prompt": ids}, model_info) == 400


@pytest.mark.parametrize("body", [{}, {"messages": []}, {"messages": "hi"}, {"messages": [{"content": "x"}]},
                                  {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}])
def test_chat_rejections(body, model_info):
    assert status_of(parse_chat, body, model_info) == 400


def test_assembler_matches_the_engine_detokenizer_on_multibyte_text(model_info):
    tok = model_info.tokenizer
    prompt = tok.encode("Say:")
    ids = tok.encode(" Très bien — ✓ 日本語 🎉 done")
    reference = IncrementalDetokenizer(tok, prompt)
    expected = "".join(reference.add(t) for t in ids)
    assembler = TextAssembler(tok, prompt)
    pieces = []
    for t in ids:
        assembler.add(t)
        pieces.append(assembler.take())
    assert "".join(pieces) == expected
    assert all("\ufffd" not in p for p in pieces)


def test_assembler_cuts_stop_strings_and_never_leaks_their_start(model_info):
    tok = model_info.tokenizer
    ids = tok.encode(" one two STOP three")
    streamed, reason = stream_through(TextAssembler(tok, [], stop=["STOP"]), ids)
    assert reason == "stop" and streamed == " one two "


def stream_through(assembler: TextAssembler, ids: list[int]) -> tuple[str, str | None]:
    """The text an assembler streams for `ids` token by token, and why it stopped (or None)."""
    streamed, reason = "", None
    for t in ids:
        reason = assembler.add(t)
        streamed += assembler.take(final=reason is not None)
        if reason:
            break
    return streamed + assembler.take(final=True), reason


def test_assembler_hides_eos_unless_ignored(model_info):
    tok = model_info.tokenizer
    eos = tok.eos_token_ids[0]
    assembler = TextAssembler(tok, [])
    assert assembler.add(eos) == "stop"
    assert TextAssembler(tok, [], ignore_eos=True).add(eos) is None


def test_sse_lines():
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line(": comment") is None and parse_sse_line("") is None
