"""Server-sent events from workers: bytes as they arrive -> JSON payloads (pure)."""

from __future__ import annotations

import json
from typing import Any

DONE = object()  # the end-of-stream marker


def parse_sse_line(line: str) -> Any:
    """One line of a server-sent event stream -> a JSON payload, DONE, or None."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data:
        return None
    if data == "[DONE]":
        return DONE
    return json.loads(data)


class SseLines:
    """Splits a byte stream into lines (pieces may cut a line, or a UTF-8 character,
    anywhere) and parses each complete one; a line is decoded only once it is whole."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[Any]:
        """Payloads (dicts, or DONE) of the lines that `data` completes, in order."""
        if self._tail:
            data = self._tail + data
        lines = data.split(b"\n")
        self._tail = lines.pop()
        out = []
        for raw in lines:
            if raw:
                payload = parse_sse_line(raw.decode())
                if payload is not None:
                    out.append(payload)
        return out
