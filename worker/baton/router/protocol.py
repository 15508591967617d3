"""OpenAI request bodies -> one validated generation request (pure: no I/O).

Every rejection is an `ApiError` carrying the HTTP status and an OpenAI-style error body.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import jinja2

from baton.engine.limits import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from baton.router.tokenizing import ModelInfo

MAX_JSON_DEPTH = 64  # an OpenAI body nests a handful of levels; deeper is an attack
ECHO_CHARS = 80  # how much of a rejected value an error message repeats
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (as vLLM's does)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
# Parameters the engine cannot honour: rejected unless they carry their neutral value.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "min_tokens": (None, 0),
    "echo": (None, False),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass
class GenerationRequest:
    kind: str  # "chat" or "completion"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False

    def worker_params(self, max_tokens: int | None = None) -> dict:
        """The engine's SamplingParams as JSON (docs/contracts.md)."""
        return {
            "max_tokens": self.max_tokens if max_tokens is None else max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "seed": self.seed, "stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos, "logprobs": None,
        }


def parse_body(kind: str, raw: bytes, model: ModelInfo) -> GenerationRequest:
    """A raw request body of `kind` ("chat" or "completion") -> the request, or ApiError."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as e:  # also bad UTF-8 and integers too long to convert
        raise bad_request(f"the request body is not valid JSON: {_clip(str(e))}") from None
    _check_depth(body)
    return parse_chat(body, model) if kind == "chat" else parse_completion(body, model)


def _check_depth(value: Any) -> None:
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def _clip(text: str) -> str:
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "..."


def _show(value: Any) -> str:
    """A client's value in an error message, cut short: never echo a whole body back."""
    if isinstance(value, str | int | float | bool) or value is None:
        return _clip(repr(value))
    return type(value).__name__


def _encode(model: ModelInfo, text: str, param: str) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"'{param}' is not valid Unicode (it holds an unpaired surrogate)",
                          param) from None
    return model.encode(text)


def parse_completion(body: Any, model: ModelInfo) -> GenerationRequest:
    body = _require_object(body)
    ids = _prompt_ids(body.get("prompt"), model)
    return _finish(body, "completion", ids, model, COMPLETION_DEFAULT_MAX_TOKENS)


def parse_chat(body: Any, model: ModelInfo) -> GenerationRequest:
    body = _require_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    flat = [_flatten_message(i, m) for i, m in enumerate(messages)]
    add_generation_prompt = body.get("add_generation_prompt", True)
    try:
        text = model.tokenizer.apply_chat_template(flat, add_generation_prompt=bool(add_generation_prompt))
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise bad_request(f"the chat template cannot render these messages: {_clip(str(e))}",
                          "messages") from e
    ids = _encode(model, text, "messages")
    if not ids:
        raise bad_request("the chat template produced an empty prompt", "messages")
    if "max_completion_tokens" in body and body.get("max_tokens") is None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    return _finish(body, "chat", ids, model, None)


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _flatten_message(index: int, message: Any) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"messages[{index}] must be an object with a 'role'", "messages")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}]: only text content parts are supported", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"messages[{index}].content must be a string", "messages")
    return {"role": message["role"], "content": content}


def _prompt_ids(prompt: Any, model: ModelInfo) -> list[int]:
    # a batch of one is accepted; larger batches are not (one prompt per request)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        return _encode(model, prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        vocab = model.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {_show(bad)} is outside the vocabulary [0, {vocab})", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("only one prompt per request is supported", "prompt")
    raise bad_request("'prompt' must be a non-empty string or a list of token ids", "prompt")


def _finish(body: dict, kind: str, ids: list[int], model: ModelInfo,
            default_max_tokens: int | None) -> GenerationRequest:
    requested = body.get("model")
    if requested is not None and requested != model.name:
        raise ApiError(404, f"the model {_show(requested)} does not exist; this server serves "
                       f"'{model.name}'", "invalid_request_error", "model", "model_not_found")
    for name, neutral in NEUTRAL_VALUES.items():
        if name in body and body[name] not in neutral:
            raise bad_request(f"'{name}'={_show(body[name])} is not supported by this server", name)
    limit = model.max_model_len
    if len(ids) >= limit:
        raise bad_request(f"this model's maximum context length is {limit} tokens; the prompt "
                          f"has {len(ids)} tokens (at least one must be left to generate)", "prompt")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else limit - len(ids)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad_request(f"'max_tokens' must be a positive integer, got {_show(max_tokens)}",
                          "max_tokens")
    if len(ids) + max_tokens > limit:
        raise bad_request(f"this model's maximum context length is {limit} tokens; you asked for "
                          f"{len(ids)} prompt tokens plus {max_tokens} completion tokens", "max_tokens")
    req = GenerationRequest(kind=kind, model=model.name, prompt_ids=ids, max_tokens=max_tokens)
    req.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if req.temperature < GREEDY_BELOW:
        req.temperature = 0.0  # dividing logits by ~0 overflows them: it means greedy anyway
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if req.top_p <= 0.0:
        raise bad_request("'top_p' must be in (0, 1]", "top_p")
    top_k = body.get("top_k", 0)
    if top_k in (None, -1):
        top_k = 0  # -1 means "off" in vLLM's convention
    if not _is_int(top_k) or top_k < 0:
        raise bad_request("'top_k' must be a non-negative integer", "top_k")
    req.top_k = top_k if top_k < model.config.vocab_size else 0  # at least the vocabulary: off
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and -(2**63) <= seed < 2**64):
        raise bad_request("'seed' must be a 64-bit integer", "seed")
    req.seed = seed
    req.stop = _stop_strings(body.get("stop"))
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise bad_request("'stop_token_ids' must be a list of integers", "stop_token_ids")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' has {len(stop_ids)} entries; at most "
                          f"{MAX_STOP_TOKEN_IDS} are allowed", "stop_token_ids")
    vocab = model.config.vocab_size
    if any(not 0 <= t < vocab for t in stop_ids):
        raise bad_request(f"'stop_token_ids' must be token ids in [0, {vocab})", "stop_token_ids")
    req.stop_token_ids = list(stop_ids)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be a boolean", "ignore_eos")
    req.ignore_eos = ignore_eos
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise bad_request("'stream' must be a boolean", "stream")
    req.stream = bool(stream)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    req.include_usage = bool(options.get("include_usage", False)) and req.stream
    return req


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    # every stop string is checked against every new token: bound the work one request buys
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has {len(stop)} strings; at most {MAX_STOP_STRINGS} are "
                          "allowed", "stop")
    longest = max(len(s) for s in stop) if stop else 0
    if longest > MAX_STOP_STRING_CHARS:
        raise bad_request(f"a 'stop' string has {longest} characters; at most "
                          f"{MAX_STOP_STRING_CHARS} are allowed", "stop")
    return list(stop)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}, got {_show(value)}", name)
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
