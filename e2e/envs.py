"""Build the environments the e2e runs images from, from what the Dockerfiles install.

    python -m e2e.envs operator PATH   a venv holding only what operator/Dockerfile installs
    python -m e2e.envs helm PATH       a Python 3.12 venv with helm-sdkpy
    python -m e2e.envs checkov PATH    a venv with the checkov security scanner (a CLI)

The operator's environment is made from the Dockerfile itself, so a dependency the image
lacks is missing here too and the e2e fails on it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON312 = ("python3.12", "/root/.pyenv/versions/3.12.1/bin/python")


def dockerfile_requirements(text: str) -> list[str]:
    """Requirement specs of the last stage's `pip install` commands (not wheels, not flags)."""
    stage = text.split("\nFROM ")[-1].replace("\\\n", " ")
    out: list[str] = []
    for command in re.findall(r"pip install ([^&\n]+)", stage):
        for word in shlex.split(command):
            if not word.startswith("-") and "/" not in word:
                out.append(word)
    return out


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True)


def operator_env(target: Path) -> None:
    _run(sys.executable, "-m", "venv", "--clear", str(target))
    pip = [str(target / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    requirements = dockerfile_requirements((ROOT / "operator" / "Dockerfile").read_text())
    _run(*pip, "--no-deps", "-e", str(ROOT))  # the image: `pip install --no-deps <wheel>`
    _run(*pip, *requirements)


def helm_env(target: Path) -> None:
    probe = "import sys; assert sys.version_info >= (3, 12)"
    python = next((p for p in PYTHON312 if subprocess.run(
        ["sh", "-c", f'{p} -c "{probe}"'], capture_output=True).returncode == 0), None)
    if python is None:
        raise SystemExit("helm-sdkpy needs Python 3.12: install python3.12")
    _run(python, "-m", "venv", "--clear", str(target))
    _run(str(target / "bin" / "python"), "-m", "pip", "install", "--quiet", "helm-sdkpy")


def checkov_env(target: Path) -> None:
    _run(sys.executable, "-m", "venv", "--clear", str(target))
    _run(str(target / "bin" / "python"), "-m", "pip", "install", "--quiet", "checkov>=3.2")


if __name__ == "__main__":
    kind, path = sys.argv[1], Path(sys.argv[2])
    {"operator": operator_env, "helm": helm_env, "checkov": checkov_env}[kind](path)
    (path / ".installed").touch()
