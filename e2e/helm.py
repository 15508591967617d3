"""Helm, for real: helm-sdkpy (Helm's Go library) installs and uninstalls the chart.

helm-sdkpy needs Python >= 3.12, so it runs in its own environment (.venv-helm, built by
`make e2e-envs`) as a subprocess that reads a JSON request on stdin.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HELM_PYTHON = ROOT / ".venv-helm" / "bin" / "python"
CHART = ROOT / "charts" / "baton"

_SCRIPT = """
import asyncio, json, sys
import helm_sdkpy

async def main(request):
    config = helm_sdkpy.Configuration(namespace=request["namespace"],
                                      kubeconfig=request["kubeconfig"])
    if request["action"] == "install":
        result = await helm_sdkpy.Install(config).run(
            request["release"], request["chart"], values=request["values"],
            create_namespace=True, wait=False, timeout=120)
    else:
        result = await helm_sdkpy.Uninstall(config).run(request["release"], wait=False, timeout=120)
    print(json.dumps(result, default=str))

asyncio.run(main(json.load(sys.stdin)))
"""


def _run(request: dict[str, Any], timeout: float) -> dict[str, Any]:
    done = subprocess.run([str(HELM_PYTHON), "-c", _SCRIPT], input=json.dumps(request),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"helm {request['action']} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def install(kubeconfig: Path, namespace: str, release: str, values: dict[str, Any],
            chart: Path = CHART, timeout: float = 180) -> dict[str, Any]:
    return _run({"action": "install", "kubeconfig": str(kubeconfig), "namespace": namespace,
                 "release": release, "chart": str(chart), "values": values}, timeout)


def uninstall(kubeconfig: Path, namespace: str, release: str, timeout: float = 180) -> dict[str, Any]:
    return _run({"action": "uninstall", "kubeconfig": str(kubeconfig), "namespace": namespace,
                 "release": release}, timeout)
