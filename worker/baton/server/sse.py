"""Server-sent events of a token stream, as docs/contracts.md defines them (pure)."""

from __future__ import annotations

import json

from baton.engine.outputs import RequestOutput

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keepalive\n\n"  # an SSE comment: readers skip it, idle timers restart


def output_event(out: RequestOutput) -> dict:
    """One event: the tokens and text that are new since the last event."""
    new = len(out.new_token_ids)
    logprobs = out.logprobs[-new:] if new and out.logprobs else None
    reason = out.finish_reason if out.finished else None
    return {
        "request_id": out.request_id,
        "token_ids": list(out.new_token_ids),
        "text": out.new_text,
        "finish_reason": reason,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_cached_tokens": out.num_cached_tokens,
        "logprobs": logprobs,
    }


def ended_event(request_id: str, reason: str) -> dict:
    """A last event for a stream that ends without a new token (abort)."""
    return {
        "request_id": request_id, "token_ids": [], "text": "", "finish_reason": reason,
        "num_prompt_tokens": None, "num_cached_tokens": None, "logprobs": None,
    }


def encode(doc: dict) -> str:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"


def data_of(line: str) -> str | None:
    """The payload of a `data:` line, or None for blank lines and comments."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()
