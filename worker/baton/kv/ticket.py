"""A ticket: the decode worker's reservation of KV blocks for one prompt.

The decode worker issues it, the router hands it to a prefill worker, and every KV frame the
prefill worker sends is checked against it. It travels as JSON (`to_dict`/`from_dict`).
"""

from __future__ import annotations

import math
import time
from dataclasses import MISSING, asdict, dataclass, fields

import torch

from baton.kv.dtypes import DTYPE_NAMES, is_known_dtype, itemsize, torch_dtype
from baton.kv.endpoint import parse_endpoint

MAX_REQUEST_ID_BYTES = 256


def _require_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; a JSON `true` where a count belongs is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")


def _require_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
    if len(value.encode()) > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"{name}: longer than {MAX_REQUEST_ID_BYTES} bytes")


@dataclass(frozen=True)
class Ticket:
    request_id: str
    worker_id: str  # identity of the decode worker that reserved the blocks
    kv_endpoint: str  # where that worker receives KV, e.g. tcp://10.0.0.5:8101
    block_ids: tuple[int, ...]  # destination blocks, in token order
    block_size: int
    dtype: str  # "bfloat16" | "float16" | "float32"
    num_layers: int
    num_kv_heads: int  # all KV heads of the model
    head_dim: int
    head_start: int  # this ticket covers heads [head_start, head_end)
    head_end: int
    num_tokens: int  # prompt tokens whose KV will arrive
    expires_at: float  # unix seconds
    # a tensor-parallel decode worker: where each of its ranks receives the KV heads it owns
    # (rank 0's is kv_endpoint); empty for a worker of one process
    rank_endpoints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.block_ids, list):
            object.__setattr__(self, "block_ids", tuple(self.block_ids))
        if isinstance(self.rank_endpoints, list):
            object.__setattr__(self, "rank_endpoints", tuple(self.rank_endpoints))
        self.validate_structure()

    # -- validation ---------------------------------------------------------------------
    def validate_structure(self) -> None:
        """Everything except expiry; raises ValueError naming the bad field."""
        _require_text("request_id", self.request_id)
        _require_text("worker_id", self.worker_id)
        parse_endpoint(self.kv_endpoint)
        if not isinstance(self.block_ids, tuple):
            raise ValueError(f"block_ids: expected a list of integers, got {self.block_ids!r}")
        for i, block in enumerate(self.block_ids):
            _require_int(f"block_ids[{i}]", block, 0)
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "num_tokens"):
            _require_int(name, getattr(self, name), 1)
        if not is_known_dtype(self.dtype):
            raise ValueError(
                f"dtype: unknown KV dtype {self.dtype!r}; expected one of {list(DTYPE_NAMES)}"
            )
        _require_int("head_start", self.head_start, 0)
        _require_int("head_end", self.head_end, 1)
        if not self.head_start < self.head_end <= self.num_kv_heads:
            raise ValueError(
                f"head_end: head range [{self.head_start}, {self.head_end}) must be non-empty "
                f"and inside the model's {self.num_kv_heads} KV heads"
            )
        needed = math.ceil(self.num_tokens / self.block_size)
        if len(self.block_ids) < needed:
            raise ValueError(
                f"block_ids: {len(self.block_ids)} blocks of {self.block_size} tokens cannot hold "
                f"num_tokens={self.num_tokens} (need {needed})"
            )
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError(
                "block_ids: a block id appears twice; tokens would overwrite each other"
            )
        if not isinstance(self.rank_endpoints, tuple):
            raise ValueError(f"rank_endpoints: expected a list of endpoints, got {self.rank_endpoints!r}")
        for endpoint in self.rank_endpoints:
            parse_endpoint(endpoint)
        if self.rank_endpoints and self.rank_endpoints[0] != self.kv_endpoint:
            raise ValueError("rank_endpoints: rank 0's endpoint must be kv_endpoint")
        if isinstance(self.expires_at, bool) or not isinstance(self.expires_at, int | float):
            raise ValueError(f"expires_at: expected unix seconds, got {self.expires_at!r}")
        if not math.isfinite(self.expires_at):
            raise ValueError(f"expires_at: expected a finite time, got {self.expires_at!r}")

    def is_expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at

    def check_not_expired(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if self.is_expired(now):
            raise ValueError(
                f"expires_at: ticket for request {self.request_id!r} expired "
                f"{now - self.expires_at:.3f}s ago"
            )

    # -- derived sizes ------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        """Heads carried by this ticket (a receiver may own only part of the model's heads)."""
        return self.head_end - self.head_start

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def layer_payload_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer on the wire: [K/V, tokens, heads, head_dim], token-major."""
        return (2, self.num_tokens, self.num_heads, self.head_dim)

    @property
    def layer_payload_nbytes(self) -> int:
        return math.prod(self.layer_payload_shape) * itemsize(self.dtype)

    @property
    def total_payload_nbytes(self) -> int:
        return self.layer_payload_nbytes * self.num_layers

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = asdict(self)
        data["block_ids"] = list(self.block_ids)
        data["rank_endpoints"] = list(self.rank_endpoints)
        return data

    @classmethod
    def from_dict(
        cls, data: object, *, now: float | None = None, allow_expired: bool = False
    ) -> Ticket:
        """Build and validate a ticket from JSON; refuses unknown or missing fields and expiry."""
        if not isinstance(data, dict):
            raise ValueError(f"ticket: expected a JSON object, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown ticket field (known: {names})")
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = [n for n in names if n not in data and n not in optional]
        if missing:
            raise ValueError(f"{missing[0]}: missing from ticket")
        block_ids = data["block_ids"]
        if not isinstance(block_ids, list | tuple):
            raise ValueError(f"block_ids: expected a list of integers, got {block_ids!r}")
        rank_endpoints = data.get("rank_endpoints", ())
        if not isinstance(rank_endpoints, list | tuple):
            raise ValueError(f"rank_endpoints: expected a list of endpoints, got {rank_endpoints!r}")
        ticket = cls(**{**data, "block_ids": tuple(block_ids), "rank_endpoints": tuple(rank_endpoints)})
        if not allow_expired:
            ticket.check_not_expired(now)
        return ticket
