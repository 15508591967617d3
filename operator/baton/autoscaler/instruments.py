"""The controller's `baton_autoscaler_*` metrics (names and labels: docs/contracts.md).

One set of metric objects per registry, shared by every Controller in the process (one per
PDDeployment), told apart by the `deployment` label. An unmeasured input is exported as NaN,
so a graph shows a gap rather than a false zero.
"""

from __future__ import annotations

import math
import threading
import weakref

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from .inputs import Action, Decision, Observation

POOLS = ("prefill", "decode")


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.desired = Gauge("baton_autoscaler_desired_workers",
                             "Workers per pool the sizing formulas want",
                             ["deployment", "pool"], registry=registry)
        self.actual = Gauge("baton_autoscaler_actual_workers",
                            "Workers per pool the controller sees now",
                            ["deployment", "pool"], registry=registry)
        self.decisions = Counter("baton_autoscaler_decisions",
                                 "Sizing decisions taken, by action",
                                 ["deployment", "action"], registry=registry)
        self.arrival_rate = Gauge("baton_autoscaler_arrival_rate",
                                  "Measured request arrival rate, requests per second",
                                  ["deployment"], registry=registry)
        self.input_length = Gauge("baton_autoscaler_input_length_tokens",
                                  "Measured mean prompt length, tokens", ["deployment"],
                                  registry=registry)
        self.output_length = Gauge("baton_autoscaler_output_length_tokens",
                                   "Measured mean output length, tokens", ["deployment"],
                                   registry=registry)
        self.hit_rate = Gauge("baton_autoscaler_prefix_hit_rate",
                              "Measured prefix-cache hit fraction of prompt tokens",
                              ["deployment"], registry=registry)
        self.in_flight = Gauge("baton_autoscaler_conversions_in_flight",
                               "Role conversions started and not finished", ["deployment"],
                               registry=registry)

    def start(self, deployment: str) -> None:
        """Create every series at once, so dashboards have data before the first action."""
        for action in Action:
            self.decisions.labels(deployment, action.value)

    def record(self, deployment: str, decision: Decision, obs: Observation) -> None:
        for pool, desired, actual in zip(POOLS, decision.desired, decision.current):
            self.desired.labels(deployment, pool).set(desired)
            self.actual.labels(deployment, pool).set(actual)
        self.decisions.labels(deployment, decision.action.value).inc()
        self.arrival_rate.labels(deployment).set(_or_nan(obs.arrival_rate))
        self.input_length.labels(deployment).set(_or_nan(obs.input_len))
        self.output_length.labels(deployment).set(_or_nan(obs.output_len))
        self.hit_rate.labels(deployment).set(_or_nan(obs.hit_rate))
        self.in_flight.labels(deployment).set(obs.conversions_in_flight)

    def forget(self, deployment: str) -> None:
        """Drop a deleted deployment's series."""
        for metric in (self.desired, self.actual):
            for pool in POOLS:
                _remove(metric, deployment, pool)
        for action in Action:
            _remove(self.decisions, deployment, action.value)
        for metric in (self.arrival_rate, self.input_length, self.output_length, self.hit_rate,
                       self.in_flight):
            _remove(metric, deployment)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


_lock = threading.Lock()
# Keyed by the registry itself, weakly: an id() key outlives its registry, and a new registry
# at the same address would get metric objects registered in the dead one.
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, AutoscalerMetrics] = weakref.WeakKeyDictionary()


def metrics_for(registry: CollectorRegistry | None = None) -> AutoscalerMetrics:
    """The metric objects of `registry` (default: the process registry), created once."""
    registry = registry or REGISTRY
    with _lock:
        if registry not in _by_registry:
            _by_registry[registry] = AutoscalerMetrics(registry)
        return _by_registry[registry]
