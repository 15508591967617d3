"""The KV transport interface, the sink the engine plugs in, and transport selection.

Decode side: a KVReceiver listens on the worker's KV endpoint and hands every accepted layer
to a KVSink (the engine's block memory). Prefill side: a KVSender connects to a receiver and
opens one KVTransfer per ticket; each finished layer goes out with `send_layer`, and
`finish` sends the first token and waits for the receiver's ACK.
"""

from __future__ import annotations

import inspect
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from baton.kv.endpoint import parse_endpoint
from baton.kv.messages import Ack, ErrorInfo
from baton.kv.ticket import Ticket

TOKEN_ENV = "BATON_INTERNAL_TOKEN"


def internal_token(explicit: str | None = None) -> str:
    """The deployment's shared token; refuses to run open when none is configured."""
    token = explicit if explicit is not None else os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ValueError(
            f"{TOKEN_ENV}: not set; the KV transport never runs without a shared token"
        )
    return token


class TransferError(Exception):
    """A KV transfer did not complete."""


class TransferRefused(TransferError):
    """The receiver refused the transfer; `info` holds its error code and message."""

    def __init__(self, info: ErrorInfo):
        super().__init__(f"{info.code}: {info.message}")
        self.info = info


class TransferTimeout(TransferError, TimeoutError):
    pass


@dataclass(frozen=True)
class ReceiveStats:
    """Receiver-side view of one completed transfer (wall-clock seconds)."""

    request_id: str
    layers: int
    total_bytes: int
    first_layer_at: float  # time.time() when the first layer arrived
    last_layer_at: float
    end_at: float  # when END arrived


class LayerWrite(ABC):
    """A claim on one layer's destination memory, for a receiver that reads the payload
    straight into it. `views` are byte ranges in wire order (K runs, then V runs); the
    receiver fills them, verifies the checksum over them, then calls `end` exactly once."""

    views: list[memoryview]

    @abstractmethod
    def end(self, ok: bool) -> None:
        """The write is over; `ok`: every byte arrived and the checksum matched (only then
        does the layer count as written). After this the receiver never touches `views`."""


class KVSink(ABC):
    """What the decode worker's engine provides to a receiver.

    Methods may be plain or `async`. They run on the receiver's event loop, so they must be
    quick: copy the payload into the cache and return. The payload tensor is only valid
    during `write_layer` (it may live in a shared-memory segment that is then removed).
    """

    @abstractmethod
    def lookup(self, request_id: str) -> Ticket | None:
        """The live ticket this worker issued for `request_id`, or None (unknown or done)."""

    @abstractmethod
    def write_layer(self, ticket: Ticket, layer: int, payload: torch.Tensor) -> None:
        """Store a verified [2, num_tokens, heads, head_dim] payload into the ticket's blocks
        (e.g. with layout.scatter_layer)."""

    def begin_layer_write(self, ticket: Ticket, layer: int) -> LayerWrite | None:
        """Optional: destination views to receive the layer into directly (no copy), or
        None for `write_layer`. Only views of the ticket's own reserved blocks; they must
        stay reserved until `end` (a cancel meanwhile frees them after it). A failed or
        corrupt write leaves those blocks with partial data; the layer is then re-sent."""
        return None

    @abstractmethod
    def finish(
        self, ticket: Ticket, first_token: int, logprob: float | None, stats: ReceiveStats,
        sampler_state: str | None = None,
    ) -> None:
        """Every layer arrived and matches END: the sequence may join the running batch.
        `sampler_state`: END's seeded sampler state after the first token (None: no seed)."""

    @abstractmethod
    def abort(self, ticket: Ticket, reason: str) -> None:
        """The transfer stopped before completion (sender gone, refused data, deadline).
        The sink decides whether to free the blocks now or keep them for a retry until the
        ticket expires. A later transfer for the same ticket starts again from layer 0."""


async def maybe_await(value):
    return await value if inspect.isawaitable(value) else value


class KVReceiver(ABC):
    """Decode side: accepts authenticated connections and feeds a KVSink."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """Address to put in tickets (valid after start())."""

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.close()


class KVTransfer(ABC):
    """Prefill side: one request's stream of layers to one receiver."""

    ticket: Ticket

    @abstractmethod
    async def send_layer(self, layer: int, payload: torch.Tensor) -> None:
        """Ship one layer ([2, num_tokens, heads, head_dim], CPU, kept until ACK for re-sends)."""

    @abstractmethod
    async def finish(
        self, first_token: int, logprob: float | None = None, timeout: float = 30.0,
        sampler_state: str | None = None,
    ) -> Ack:
        """Send END (with the sampler state of a seeded request) and wait (at most `timeout`
        s) for ACK; raises TransferError otherwise."""

    @abstractmethod
    async def abort(self) -> None:
        """Give up; release held payloads."""


class KVSender(ABC):
    """Prefill side: a connection to one decode worker's receiver, shared by its transfers."""

    @abstractmethod
    async def open(self, ticket: Ticket) -> KVTransfer: ...

    @abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class Transport(ABC):
    """A family of receiver and sender classes that speak to each other."""

    name: str

    @abstractmethod
    def receiver(
        self, sink: KVSink, *, worker_id: str, address: str, token: str | None = None, **options
    ) -> KVReceiver:
        """`address`: "host:port" for tcp, a name for shm."""

    @abstractmethod
    def sender(
        self, endpoint: str, *, worker_id: str, token: str | None = None, **options
    ) -> KVSender: ...


TRANSPORT_NAMES = ("tcp", "shm", "gpu")


def select_transport(name: str = "auto", endpoint: str | None = None) -> Transport:
    """ "tcp", "shm", "gpu", or "auto": follow the endpoint's scheme (tcp when none is given).

    The GPU slot is never picked by "auto" until it is implemented; asking for it by name
    raises NotImplementedError explaining why.
    """
    if name == "auto":
        name = parse_endpoint(endpoint).scheme if endpoint else "tcp"
    if name == "tcp":
        from baton.kv.tcp import TcpTransport

        return TcpTransport()
    if name == "shm":
        from baton.kv.shm import ShmTransport

        return ShmTransport()
    if name == "gpu":
        from baton.kv.gpu import GpuTransport

        return GpuTransport()
    raise ValueError(
        f"transport: unknown name {name!r}; expected 'auto' or one of {list(TRANSPORT_NAMES)}"
    )
