"""`baton remove-deployments`: delete every PDDeployment and wait until the operator has
drained and removed them (the chart's pre-delete hook runs it before `helm uninstall`
removes the operator, which would otherwise leave them stuck on its finalizer)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import Any

import kopf

from .kube import KubeApi

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[],
                        help="only this namespace (repeatable); default: every namespace")
    parser.add_argument("--timeout-seconds", type=float, default=600.0,
                        help="longest wait for the operator to drain and remove them")
    parser.add_argument("--poll-seconds", type=float, default=2.0)


def names_of(items: list[dict[str, Any]]) -> list[str]:
    return sorted(f"{i['metadata'].get('namespace')}/{i['metadata']['name']}" for i in items)


async def remove_deployments(api: KubeApi, namespaces: list[str], timeout_s: float,
                             poll_s: float = 2.0) -> list[str]:
    """Delete them all, then wait; returns those still present at the deadline."""
    scopes: list[str | None] = list(namespaces) or [None]

    async def present() -> list[dict[str, Any]]:
        found = []
        for namespace in scopes:
            found.extend(await api.list("PDDeployment", namespace, {}))
        return found

    for item in await present():
        if not item["metadata"].get("deletionTimestamp"):
            meta = item["metadata"]
            await api.delete("PDDeployment", meta["namespace"], meta["name"])
            print(f"deleting PDDeployment {meta['namespace']}/{meta['name']}", flush=True)
    deadline = time.monotonic() + timeout_s
    while True:
        left = await present()
        if not left or time.monotonic() >= deadline:
            return names_of(left)
        await asyncio.sleep(poll_s)


async def _login() -> kopf.ConnectionInfo:
    settings = kopf.OperatorSettings()
    info = (kopf.login_with_service_account(settings=settings)
            or kopf.login_with_kubeconfig(settings=settings))
    if info is None:
        raise SystemExit("no service account token and no kubeconfig to log in with")
    return info


async def _main(args: argparse.Namespace) -> int:
    api = KubeApi(await _login())
    try:
        left = await remove_deployments(api, args.namespace, args.timeout_seconds,
                                        args.poll_seconds)
    finally:
        await api.aclose()
    if left:
        print(f"still present after {args.timeout_seconds:g}s (the operator is draining them, "
              f"or is not running): {', '.join(left)}. Wait and run `helm uninstall` again; "
              "to give up on draining, remove the finalizer baton.dev/operator from each.",
              file=sys.stderr)
        return 1
    print("every PDDeployment is gone", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO)
    return asyncio.run(_main(args))
