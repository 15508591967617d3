"""One handoff split into several transfers, one per (prefill rank, decode rank) route
(pure: naming, sub-tickets and the bookkeeping of which heads arrived).

Each route moves a range of KV heads for every layer, as an ordinary transfer with its own
ticket: the decode worker's ticket narrowed to the route's heads and pointed at the decode
rank that owns them. Its request id on the wire names the request, the attempt (a retried
prefill sends again under a new one) and the heads, so the receiver keeps the routes of one
request apart and the same route of two attempts too. A handoff of one route from a worker
of one process to another keeps the request's own id and the ticket as issued.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from baton.kv.ticket import Ticket

_ROUTE_ID = re.compile(r"(?P<rid>.+)#kv:(?P<attempt>[0-9a-f]{1,32}):(?P<start>\d+)-(?P<end>\d+)")


@dataclass(frozen=True)
class RouteId:
    request_id: str
    attempt: str
    head_start: int
    head_end: int

    def __str__(self) -> str:
        return f"{self.request_id}#kv:{self.attempt}:{self.head_start}-{self.head_end}"


def parse_route_id(transfer_id: str) -> RouteId | None:
    """The route a transfer's id names, or None for a plain request id."""
    m = _ROUTE_ID.fullmatch(transfer_id)
    if m is None:
        return None
    return RouteId(m["rid"], m["attempt"], int(m["start"]), int(m["end"]))


def target_endpoints(ticket: Ticket) -> tuple[str, ...]:
    """Where each decode rank receives its heads (one entry for a worker of one process)."""
    return ticket.rank_endpoints or (ticket.kv_endpoint,)


def route_ticket(ticket: Ticket, route: RouteId, endpoint: str) -> Ticket:
    """The ticket of one route: the issued ticket narrowed to the route's heads and sent to
    the decode rank at `endpoint` under the route's id."""
    if route.request_id != ticket.request_id:
        raise ValueError(f"route {route} is not for request {ticket.request_id!r}")
    if not ticket.head_start <= route.head_start < route.head_end <= ticket.head_end:
        raise ValueError(f"route heads [{route.head_start}, {route.head_end}) are outside the ticket's "
                         f"[{ticket.head_start}, {ticket.head_end})")
    return replace(ticket, request_id=str(route), kv_endpoint=endpoint, head_start=route.head_start,
                   head_end=route.head_end, rank_endpoints=())


@dataclass
class HeadCoverage:
    """Which of a decode rank's heads [start, end) have arrived whole (every layer, END
    verified) for one request; routes of different attempts may each bring some."""

    start: int
    end: int
    done: set[int] = field(default_factory=set)

    def add(self, head_start: int, head_end: int) -> bool:
        """Record a finished route; True once every head is in."""
        if not self.start <= head_start < head_end <= self.end:
            raise ValueError(f"heads [{head_start}, {head_end}) are not among this rank's [{self.start}, {self.end})")
        self.done.update(range(head_start, head_end))
        return self.complete

    @property
    def complete(self) -> bool:
        return len(self.done) == self.end - self.start
