"""Receiver-side rules for one request's transfer (pure: no sockets, no clocks of its own).

The transports feed frame headers in and get back either a refusal or a go-ahead; they do
the reading and writing. Keeping the rules here means TCP and shared memory refuse exactly
the same things with exactly the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.kv.messages import EndSummary, ErrorCode, ErrorInfo
from baton.kv.ticket import Ticket
from baton.kv.wire import FrameHeader


class Refusal(Exception):
    """A frame the receiver will not take; becomes an ERROR frame."""

    def __init__(self, code: ErrorCode, message: str, layer: int = -1):
        super().__init__(message)
        self.info = ErrorInfo(code=code, message=message, layer=layer)


def check_ticket_usable(
    ticket: Ticket | None, request_id: str, worker_id: str, now: float
) -> Ticket:
    if ticket is None:
        raise Refusal(
            ErrorCode.UNKNOWN_REQUEST, f"no reservation for request {request_id!r} on this worker"
        )
    if ticket.worker_id != worker_id:
        raise Refusal(
            ErrorCode.WRONG_WORKER,
            f"ticket for request {request_id!r} belongs to worker {ticket.worker_id!r}, this is {worker_id!r}",
        )
    if ticket.is_expired(now):
        raise Refusal(
            ErrorCode.EXPIRED,
            f"ticket for request {request_id!r} expired {now - ticket.expires_at:.3f}s ago",
        )
    return ticket


def check_layer_matches_ticket(h: FrameHeader, t: Ticket) -> None:
    """The frame must describe exactly the slice of KV the ticket reserved."""
    if not 0 <= h.layer < t.num_layers:
        raise Refusal(
            ErrorCode.LAYER_OUT_OF_RANGE, f"layer {h.layer} is outside [0, {t.num_layers})", h.layer
        )
    problems = []
    if h.dtype != t.dtype:
        problems.append(f"dtype {h.dtype} != {t.dtype}")
    if (h.token_start, h.token_end) != (0, t.num_tokens):
        problems.append(f"tokens [{h.token_start}, {h.token_end}) != [0, {t.num_tokens})")
    if (h.head_start, h.head_end) != (t.head_start, t.head_end):
        problems.append(f"heads [{h.head_start}, {h.head_end}) != [{t.head_start}, {t.head_end})")
    if tuple(h.shape) != t.layer_payload_shape:
        problems.append(f"shape {tuple(h.shape)} != {t.layer_payload_shape}")
    # The sender names the destination blocks; they must be the reserved ones, or a sender
    # could write into another request's memory.
    used = -(-t.num_tokens // t.block_size)
    if tuple(h.block_ids) != tuple(t.block_ids[:used]):
        problems.append("block ids differ from the reservation")
    if problems:
        raise Refusal(
            ErrorCode.SHAPE_MISMATCH,
            f"layer {h.layer} of {h.request_id!r} does not match its ticket: "
            + "; ".join(problems),
            h.layer,
        )


@dataclass
class TransferProgress:
    """What has arrived for one request."""

    ticket: Ticket
    layer_crcs: dict[int, int] = field(default_factory=dict)
    bytes_received: int = 0
    end: EndSummary | None = None
    first_frame_at: float | None = None
    last_layer_at: float | None = None
    frame_nbytes: int = 0  # one LAYER frame on the stream, header and inline payload

    @property
    def layers_due(self) -> int:
        return self.ticket.num_layers - len(self.layer_crcs)

    def check_new_layer(self, h: FrameHeader) -> None:
        check_layer_matches_ticket(h, self.ticket)
        if h.layer in self.layer_crcs:
            raise Refusal(
                ErrorCode.DUPLICATE_LAYER,
                f"layer {h.layer} of {h.request_id!r} already arrived",
                h.layer,
            )

    def record_layer(self, h: FrameHeader, now: float) -> None:
        self.layer_crcs[h.layer] = h.payload_crc
        self.bytes_received += h.payload_nbytes
        self.first_frame_at = self.first_frame_at if self.first_frame_at is not None else now
        self.last_layer_at = now

    @property
    def all_layers(self) -> bool:
        return len(self.layer_crcs) == self.ticket.num_layers

    @property
    def missing_layers(self) -> list[int]:
        return [i for i in range(self.ticket.num_layers) if i not in self.layer_crcs]

    def record_end(self, end: EndSummary) -> None:
        if self.end is not None:
            raise Refusal(ErrorCode.PROTOCOL, f"second END for {self.ticket.request_id!r}")
        if len(end.layer_checksums) != self.ticket.num_layers:
            raise Refusal(
                ErrorCode.SUMMARY_MISMATCH,
                f"END lists {len(end.layer_checksums)} layer checksums, ticket has {self.ticket.num_layers} layers",
            )
        if end.total_bytes != self.ticket.total_payload_nbytes:
            raise Refusal(
                ErrorCode.SUMMARY_MISMATCH,
                f"END says {end.total_bytes} bytes, ticket implies {self.ticket.total_payload_nbytes}",
            )
        self.end = end

    def ready_to_finish(self) -> bool:
        """True once END and every layer are in and they agree; raises on disagreement."""
        if self.end is None or not self.all_layers:
            return False
        bad = [i for i, crc in enumerate(self.end.layer_checksums) if self.layer_crcs[i] != crc]
        if bad:
            raise Refusal(
                ErrorCode.SUMMARY_MISMATCH,
                f"layers {bad} of {self.ticket.request_id!r} arrived with checksums END does not list",
            )
        return True
