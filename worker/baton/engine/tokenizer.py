"""Tokenizer, chat template and incremental detokenization."""

from __future__ import annotations

from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ):
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template = None
        if chat_template:
            # a template comes with the model's files: it runs sandboxed, so it can reach no
            # Python internals (attributes like __class__) and change none of its arguments
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(chat_template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must have 'role' and 'content'")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=self._tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else "",
            )
        except SecurityError as exc:
            raise ValueError(f"chat template: refused by the sandbox: {exc}") from None
        except ValueError:
            raise  # raise_exception() in the template: already says so
        except Exception as exc:  # the template is data: whatever fails in it is its error
            raise ValueError(f"chat template: {type(exc).__name__}: {exc}") from None


def _raise_template_error(message: str):
    raise ValueError(f"chat template: {message}")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a character.

    Decodes a short window of recent tokens and emits the new text only once it no longer
    ends in a replacement character (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-4:]) if prompt_ids else []
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # tokens before this are already emitted
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
