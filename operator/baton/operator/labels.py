"""Label and annotation names shared with routers and Services (see docs/contracts.md)."""

from __future__ import annotations

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
DEPLOYMENT = "baton.dev/deployment"
ROLE = "baton.dev/role"
STATE = "baton.dev/state"
# ranks per worker pod: read by the worker at each container start, like its role, so a
# pod converted into a pool of another size comes back at that size
TENSOR_PARALLEL = "baton.dev/tensor-parallel-size"

STATE_ACTIVE = "active"
STATE_DRAINING = "draining"
STATE_RESHARDING = "resharding"

WORKER = "worker"
ROUTER = "router"

# The operator's own pods carry these (the chart's pod template): worker NetworkPolicies
# admit them to port 8100.
OPERATOR_POD = {"app.kubernetes.io/part-of": "baton", COMPONENT: "operator"}

# Annotations on worker pods: progress of drains and conversions survives operator restarts.
DRAIN_DEADLINE = "baton.dev/drain-deadline"
CONVERSION_STARTED = "baton.dev/conversion-started"
TEMPLATE_HASH = "baton.dev/template-hash"

WORKER_PORT = 8100
KV_PORT = 8101
ROUTER_PORT = 8000


def common(deployment: str, component: str) -> dict[str, str]:
    return {
        NAME: "baton",
        INSTANCE: deployment,
        COMPONENT: component,
        MANAGED_BY: "baton-operator",
        DEPLOYMENT: deployment,
    }


def selector(deployment: str, component: str) -> dict[str, str]:
    """The labels that identify a component; stable, so usable as immutable selectors."""
    return {NAME: "baton", DEPLOYMENT: deployment, COMPONENT: component}


def worker(deployment: str, role: str, state: str = STATE_ACTIVE) -> dict[str, str]:
    return {**common(deployment, WORKER), ROLE: role, STATE: state}
