"""OpenAI response bodies and stream chunks (pure)."""

from __future__ import annotations

import json
import time


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(kind: str, request_id: str, model: str, text: str, finish_reason: str | None,
                  prompt_tokens: int, completion_tokens: int, created: int | None = None) -> dict:
    created = created or int(time.time())
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def stream_chunk(kind: str, request_id: str, model: str, created: int, text: str,
                 finish_reason: str | None = None, first: bool = False) -> dict:
    if kind == "chat":
        delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
        if finish_reason is not None and not text and not first:
            delta = {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: str, request_id: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
