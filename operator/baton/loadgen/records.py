"""Request records back from a result JSON (for plots made after the run)."""

from __future__ import annotations

from dataclasses import fields

from baton.loadgen.stats import RequestRecord

_FIELDS = {f.name for f in fields(RequestRecord)}


def records_from_json(result: dict) -> list[RequestRecord]:
    return [RequestRecord(**{k: v for k, v in r.items() if k in _FIELDS}) for r in result["requests"]]
