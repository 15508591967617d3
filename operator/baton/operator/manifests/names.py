"""Names of the objects one PDDeployment owns (one place, so lookups and builders agree)."""

from __future__ import annotations

import secrets


def secret_name(deployment: str) -> str:
    return f"{deployment}-internal-token"


def pool_service_name(deployment: str, role: str) -> str:
    return f"{deployment}-{role}"


def router_name(deployment: str) -> str:
    return f"{deployment}-router"


def router_service_name(deployment: str) -> str:
    return deployment  # the address clients use: http://NAME.NAMESPACE:8000


def workers_policy_name(deployment: str) -> str:
    return f"{deployment}-workers"


def new_worker_pod_name(deployment: str) -> str:
    # Not named after the role: a pod keeps its name when it converts to the other role.
    return f"{deployment}-w-{secrets.token_hex(3)}"
