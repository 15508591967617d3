"""Control documents carried as JSON in HELLO, END, ACK and ERROR frames (pure).

Optional fields added after a document's first version are left out while they hold their
default, so such a document encodes to the bytes it always had, and a receiver that predates
the field still reads it; a receiver refuses a field it does not know, so a document that
needs the new field fails loudly there instead of being half understood.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from baton.kv.wire import FrameHeader, FrameKind, WireError, control_header


class ErrorCode(StrEnum):
    AUTH = "auth"  # missing or wrong shared token
    WRONG_WORKER = "wrong_worker"  # ticket or connection meant for another decode worker
    UNKNOWN_REQUEST = "unknown_request"
    EXPIRED = "expired"
    ALREADY_DONE = "already_done"  # request already completed on this receiver
    CHECKSUM = "checksum"  # payload corrupted in flight: the sender re-sends that layer
    DUPLICATE_LAYER = "duplicate_layer"
    LAYER_OUT_OF_RANGE = "layer_out_of_range"
    SHAPE_MISMATCH = (
        "shape_mismatch"  # dtype, tokens, heads, head_dim or blocks disagree with ticket
    )
    INCOMPLETE = "incomplete"  # END came but layers stayed missing until the deadline
    SUMMARY_MISMATCH = "summary_mismatch"  # END's byte count or layer checksums disagree
    PROTOCOL = "protocol"  # malformed frame; the connection is closed
    SINK = "sink"  # the engine refused or failed to take the data


# A checksum refusal is the only one a re-send can fix.
RETRYABLE = frozenset({ErrorCode.CHECKSUM})


@dataclass(frozen=True)
class Hello:
    token: str
    worker_id: str  # the decode worker the sender means to reach
    sender_id: str = ""


@dataclass(frozen=True)
class EndSummary:
    first_token: int
    total_bytes: int
    layer_checksums: list[int] = field(default_factory=list)  # CRC32C per layer, in order
    logprob: float | None = None
    # a seeded request's sampler state after the first token (opaque here; the engine's
    # sampler_state module reads it): the decode worker continues that random stream
    sampler_state: str | None = None


MAX_SAMPLER_STATE_CHARS = 1 << 16
_OMITTED_WHEN_DEFAULT = {EndSummary: ("sampler_state",)}


@dataclass(frozen=True)
class Ack:
    layers: int = 0
    total_bytes: int = 0


@dataclass(frozen=True)
class ErrorInfo:
    code: ErrorCode
    message: str
    layer: int = -1


_TYPES = {
    FrameKind.HELLO: Hello,
    FrameKind.END: EndSummary,
    FrameKind.ACK: Ack,
    FrameKind.ERROR: ErrorInfo,
}


def encode_control(kind: FrameKind, request_id: str, doc) -> tuple[FrameHeader, bytes]:
    if not isinstance(doc, _TYPES[kind]):
        raise TypeError(
            f"{kind.name} frames carry {_TYPES[kind].__name__}, got {type(doc).__name__}"
        )
    fields = asdict(doc)
    for name in _OMITTED_WHEN_DEFAULT.get(type(doc), ()):
        if fields[name] is None:
            del fields[name]
    payload = json.dumps(fields, separators=(",", ":")).encode()
    layer = doc.layer if isinstance(doc, ErrorInfo) else -1
    return control_header(kind, request_id, payload, layer), payload


def _int(doc: dict, name: str, minimum: int = 0) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise WireError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


def _str(doc: dict, name: str) -> str:
    value = doc.get(name)
    if not isinstance(value, str):
        raise WireError(f"{name}: expected a string, got {value!r}")
    return value


def decode_control(header: FrameHeader, payload) -> Hello | EndSummary | Ack | ErrorInfo:
    """Parse a verified control payload; raises WireError naming the bad field."""
    if header.kind not in _TYPES:
        raise WireError(f"kind: {header.kind.name} is not a control frame")
    try:
        doc = json.loads(bytes(payload))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"{header.kind.name}: payload is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise WireError(f"{header.kind.name}: payload must be a JSON object")
    known = set(_TYPES[header.kind].__dataclass_fields__)
    unknown = sorted(set(doc) - known)
    if unknown:
        raise WireError(f"{unknown[0]}: unknown field in {header.kind.name}")
    if header.kind == FrameKind.HELLO:
        return Hello(
            token=_str(doc, "token"),
            worker_id=_str(doc, "worker_id"),
            sender_id=_str(doc, "sender_id"),
        )
    if header.kind == FrameKind.ACK:
        return Ack(layers=_int(doc, "layers"), total_bytes=_int(doc, "total_bytes"))
    if header.kind == FrameKind.ERROR:
        try:
            code = ErrorCode(_str(doc, "code"))
        except ValueError:
            raise WireError(f"code: unknown error code {doc.get('code')!r}") from None
        return ErrorInfo(code=code, message=_str(doc, "message"), layer=_int(doc, "layer", -1))
    sums = doc.get("layer_checksums")
    if not isinstance(sums, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**32 for c in sums
    ):
        raise WireError("layer_checksums: expected a list of CRC32C values")
    logprob = doc.get("logprob")
    if logprob is not None and (
        isinstance(logprob, bool)
        or not isinstance(logprob, int | float)
        or not math.isfinite(logprob)
    ):
        raise WireError(f"logprob: expected a finite number or null, got {logprob!r}")
    sampler_state = doc.get("sampler_state")
    if sampler_state is not None and (
        not isinstance(sampler_state, str) or not 0 < len(sampler_state) <= MAX_SAMPLER_STATE_CHARS
    ):
        raise WireError(
            f"sampler_state: expected a non-empty string of at most {MAX_SAMPLER_STATE_CHARS} "
            f"chars or null, got {type(sampler_state).__name__}"
        )
    return EndSummary(
        first_token=_int(doc, "first_token"),
        total_bytes=_int(doc, "total_bytes"),
        layer_checksums=sums,
        logprob=None if logprob is None else float(logprob),
        sampler_state=sampler_state,
    )
