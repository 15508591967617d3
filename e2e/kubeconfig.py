"""A kubeconfig that kubectl (and any client library) accepts for the local cluster."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

CONTEXT = "baton-e2e"


def render(server: str, ca: Path, token: str, namespace: str = "default") -> str:
    return yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {
            "server": server,
            "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode()}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": "admin",
                                                   "namespace": namespace}}],
        "current-context": CONTEXT,
    }, sort_keys=False)
