"""The security scan: checkov over the objects the chart and the operator really created.

Every failed check must be fixed or justified in docs/kubernetes.md ("Security scan"); the
justified ones are read from that table, so the documentation and the scan stay in step.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"
SERVER_FIELDS = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields",
                 "ownerReferences", "deletionTimestamp", "deletionGracePeriodSeconds")


def as_authored(obj: dict[str, Any]) -> dict[str, Any]:
    """The object without what the server and the node added (pure)."""
    out = {k: v for k, v in obj.items() if k != "status"}
    out["metadata"] = {k: v for k, v in obj["metadata"].items() if k not in SERVER_FIELDS}
    return out


def scan(objects: list[dict[str, Any]], folder: Path) -> list[dict[str, str]]:
    """checkov's failed checks over `objects`: check id, name and resource (Kind.ns.name)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, obj in enumerate(objects):
        (folder / f"{i:03d}-{obj['kind']}-{obj['metadata']['name']}.yaml").write_text(
            yaml.safe_dump(as_authored(obj)))
    done = subprocess.run([str(CHECKOV), "-d", str(folder), "--framework", "kubernetes", "-o",
                           "json", "--quiet", "--compact", "--skip-download"],
                          capture_output=True, text=True, timeout=600)
    if not done.stdout.strip():
        raise RuntimeError(f"checkov printed nothing: {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    reports = report if isinstance(report, list) else [report]
    return [{"id": c["check_id"], "name": c["check_name"], "resource": c["resource"]}
            for r in reports for c in (r.get("results") or {}).get("failed_checks") or []]


def justified(doc: str) -> dict[str, str]:
    """Check id -> the reason given in docs/kubernetes.md's "Security scan" table."""
    section = doc.split("### Security scan", 1)[-1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2).strip() for m in
            re.finditer(r"^\| `?(CKV2?_K8S_\d+)`? \|[^|]*\| (.+) \|$", section, re.MULTILINE)}
