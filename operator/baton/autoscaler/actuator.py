"""How the control loop acts: the interface every actuator (Kubernetes, local/Ray) provides."""

from __future__ import annotations

from typing import Protocol

from .estimate import PoolState
from .inputs import Decision


class ActuationError(Exception):
    """The decision could not be carried out now (nothing to convert, no scaling hook, ...)."""


class Actuator(Protocol):
    async def pools(self) -> PoolState | None:
        """The committed split and conversions in flight; None: take counts from the metrics."""
        ...

    async def apply(self, decision: Decision) -> str:
        """Start carrying out a non-hold decision; return what was done, in words.

        Must not wait for a conversion to finish: the loop keeps measuring meanwhile, and
        `pools().in_flight` reports it until it is done.
        """
        ...

    async def aclose(self) -> None: ...
