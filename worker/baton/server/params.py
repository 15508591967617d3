"""Request fields from JSON to engine types, with errors that name the bad field (pure)."""

from __future__ import annotations

from dataclasses import fields

from baton.engine.sampling import SamplingParams
from baton.server.errors import bad_request

PARAM_NAMES = tuple(f.name for f in fields(SamplingParams))


def sampling_params(data: object) -> SamplingParams:
    """`params` of a request: the engine's SamplingParams as JSON; unknown keys are refused."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise bad_request(f"params: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(PARAM_NAMES))
    if unknown:
        raise bad_request(f"params.{unknown[0]}: unknown sampling parameter (known: {list(PARAM_NAMES)})")
    try:
        params = SamplingParams(**data)
        params.validate()
    except (TypeError, ValueError) as exc:
        raise bad_request(f"params: {exc}") from None
    return params


def request_id(data: dict) -> str:
    value = data.get("request_id")
    if not isinstance(value, str) or not value or len(value.encode()) > 256:
        raise bad_request("request_id: expected a non-empty string of at most 256 bytes")
    return value


def prompt_token_ids(data: dict) -> list[int]:
    ids = data.get("prompt_token_ids")
    if not isinstance(ids, list) or not ids:
        raise bad_request("prompt_token_ids: expected a non-empty list of token ids")
    if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
        raise bad_request("prompt_token_ids: every entry must be an integer token id")
    return ids


def positive_number(data: dict, name: str, default: float, maximum: float) -> float:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= maximum:
        raise bad_request(f"{name}: expected a number in (0, {maximum}], got {value!r}")
    return float(value)


def non_negative_int(data: dict, name: str, default: int) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"{name}: expected a non-negative integer, got {value!r}")
    return value
