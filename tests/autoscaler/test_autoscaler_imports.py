"""The autoscaler core knows nothing of kopf or Kubernetes: `baton up` runs it on Ray, the
simulator offline, and the operator wraps it (baton.operator.autoscaling)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import baton.autoscaler

PACKAGE = Path(baton.autoscaler.__file__).parent
# Kubernetes clients and the operator: none may be imported by the core, even lazily.
FORBIDDEN = ("kopf", "kubernetes", "kubernetes_asyncio", "kr8s", "lightkube", "pykube",
             "baton.operator")


def forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module or "")
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 2:
            # climbing out of baton.autoscaler: "from ..operator import x" is baton.operator
            base = f"baton.{node.module}" if node.module else "baton"
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_autoscaler_module_imports_kopf_kubernetes_or_the_operator():
    found = {path.name: sorted(n for n in imported_names(path) if forbidden(n))
             for path in sorted(PACKAGE.glob("*.py"))}
    assert len(found) > 10  # the walk did read the package
    assert {name: bad for name, bad in found.items() if bad} == {}


def test_importing_the_whole_autoscaler_loads_no_kubernetes_client():
    modules = sorted(f"baton.autoscaler.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} "
            f"or m.startswith('baton.operator')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
