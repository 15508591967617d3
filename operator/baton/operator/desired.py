"""What the worker pools should be now: the spec's sizes, or the controller's target (pure).

The spec belongs to whoever applies it (a person, a GitOps tool). While autoscaling is on,
the controller writes its own pool sizes and conversion requests to `status.target`, which
no `kubectl apply` reverts; the operator follows them, kept within the spec's bounds. With
autoscaling off, or before the controller's first decision, the spec's replicas rule.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from baton.api.models import ControllerTarget, PDDeploymentSpec, PoolBounds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Desired:
    prefill: int
    decode: int
    conversions: dict[str, str] = field(default_factory=dict)  # pod -> role it is to take
    by_controller: bool = False  # sizes from status.target, not from spec.*.replicas

    def replicas(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode if role == "decode" else 0


def controller_target(status: dict[str, Any] | None) -> ControllerTarget | None:
    """status.target as written by the controller; None when absent or malformed."""
    raw = (status or {}).get("target")
    if not raw:
        return None
    try:
        return ControllerTarget.model_validate(raw)
    except ValidationError as error:
        log.warning("ignoring a malformed status.target: %s", error)
        return None


def _within(value: int, bounds: PoolBounds) -> int:
    return max(bounds.min, min(bounds.max, value))


def desired_state(spec: PDDeploymentSpec, target: ControllerTarget | None) -> Desired:
    settings = spec.autoscaling
    if not settings.enabled or target is None:
        return Desired(spec.prefill.replicas, spec.decode.replicas)
    return Desired(
        _within(target.prefill, settings.prefill),
        _within(target.decode, settings.decode),
        {c.pod: c.to_role for c in target.conversions},
        by_controller=True,
    )
