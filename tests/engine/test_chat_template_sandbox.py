"""Chat templates come with a model's files: they render in a sandbox."""

from __future__ import annotations

import pytest

from baton.engine.tokenizer import Tokenizer

HOSTILE = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ messages.append({'role': 'system', 'content': 'x'}) }}",  # no changes to the input
    "{{ cycler.__init__.__globals__.os }}",
]


@pytest.fixture(scope="module")
def bundled_tokenizer():
    from baton.router.tokenizing import load_model_info

    return load_model_info(None, served_name="smollm2").tokenizer


@pytest.mark.parametrize("template", HOSTILE)
def test_a_hostile_template_cannot_reach_python_internals(bundled_tokenizer, template):
    tok = Tokenizer(bundled_tokenizer._tok, bundled_tokenizer.eos_token_ids, chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template: "):
        tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_an_unsafe_attribute_alone_renders_as_nothing(bundled_tokenizer):
    tok = Tokenizer(bundled_tokenizer._tok, bundled_tokenizer.eos_token_ids,
                    chat_template="[{% for m in messages %}{{ m.__class__ }}{{ m.items.__self__ }}{% endfor %}]")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[]"


def test_the_bundled_template_still_renders(bundled_tokenizer):
    text = bundled_tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Capital of France?"}])
    assert "Capital of France?" in text and "Be brief." in text
    assert text.rstrip().endswith("assistant")


def test_a_template_error_is_a_clear_value_error(bundled_tokenizer):
    tok = Tokenizer(bundled_tokenizer._tok, bundled_tokenizer.eos_token_ids,
                    chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(ValueError, match="chat template: only user turns"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    bad = Tokenizer(bundled_tokenizer._tok, bundled_tokenizer.eos_token_ids, chat_template="{{ 1 + none }}")
    with pytest.raises(ValueError, match="chat template: "):
        bad.apply_chat_template([{"role": "user", "content": "hi"}])
