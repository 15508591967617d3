"""The operator image installs everything the operator imports.

operator/Dockerfile installs the Baton wheel without its dependencies (no torch) and then
names the control plane's packages by hand, so a new import in the operator, the API or the
autoscaler fails at the image's start unless it is added there too. This test walks the
imports of what the image runs (`baton operator`, `baton crds`, the uninstall hook), module
by module through Baton's own packages, function-level imports included, and checks each
third-party module against the packages that Dockerfile's `pip install` brings in, with
their own dependencies.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import shlex
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "operator" / "Dockerfile"
SOURCE_ROOTS = (ROOT / "operator", ROOT / "worker")
# What the image runs: the `baton` command and the subcommands the chart starts in it.
ENTRY_MODULES = ("baton.cli", "baton.operator.main", "baton.operator.__main__", "baton.api.crdgen",
                 "baton.operator.uninstall")


def final_stage(dockerfile: str) -> str:
    """The text of the last FROM stage, with line continuations joined."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    return re.split(r"^FROM\s", joined, flags=re.MULTILINE)[-1]


def pip_requirements(dockerfile: str) -> list[Requirement]:
    """Requirements named by `pip install` in the final stage (local wheels excluded)."""
    found: list[Requirement] = []
    for line in final_stage(dockerfile).splitlines():
        if not line.startswith("RUN "):
            continue
        for command in re.split(r"&&|;", line[4:]):
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            for word in words[2:]:
                if word.startswith("-") or "/" in word:
                    continue  # options, and the project's own wheel
                found.append(Requirement(word))
    return found


def installed_closure(requirements: list[Requirement]) -> set[str]:
    """Canonical names of the distributions pip installs for `requirements`, dependencies
    included (as this environment resolves them), no extras."""
    seen: set[str] = set()
    todo = [r.name for r in requirements]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or []:
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def module_file(module: str) -> Path | None:
    """The source file of a Baton module (a package's __init__.py), None if not Baton's."""
    parts = module.split(".")
    if parts[0] != "baton":
        return None
    for root in SOURCE_ROOTS:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path) -> set[str]:
    """Absolute names imported anywhere in the file (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skipped = {id(n) for top in ast.walk(tree) if isinstance(top, ast.If) and _is_type_checking(top)
               for n in ast.walk(top)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names.add(origin)
            # `from pkg import sub` imports the submodule when there is one
            names.update(f"{origin}.{alias.name}" for alias in node.names
                         if module_file(f"{origin}.{alias.name}") is not None)
    return names


def third_party_imports(entries: tuple[str, ...]) -> dict[str, str]:
    """Top-level third-party module -> a Baton module that imports it."""
    todo, seen, found = list(entries), set(), {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parents run first
        path = module_file(module)
        if path is None:
            continue
        for name in imports_of(module, path):
            top = name.split(".")[0]
            if top == "baton":
                todo.append(name)
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, module)
    return found


def test_the_operator_image_installs_every_module_the_operator_imports():
    requirements = pip_requirements(DOCKERFILE.read_text())
    assert requirements, "no pip install found in operator/Dockerfile"
    image = installed_closure(requirements)
    providers = metadata.packages_distributions()
    missing = []
    for top, importer in sorted(third_party_imports(ENTRY_MODULES).items()):
        dists = {canonicalize_name(d) for d in providers.get(top, [])}
        assert dists, f"{top} (imported by {importer}) belongs to no installed distribution"
        if not dists & image:
            missing.append(f"{top} (imported by {importer}; pip package {sorted(dists)[0]})")
    assert not missing, "operator/Dockerfile does not install: " + ", ".join(missing)


def test_the_walk_finds_lazy_imports_and_stays_out_of_the_data_plane():
    found = third_party_imports(ENTRY_MODULES)
    assert found["prometheus_client"]  # imported inside baton.operator.main.run
    assert "kopf" in found and "pydantic" in found and "yaml" in found
    assert "torch" not in found  # the image holds no torch: the operator must never import it


def test_the_dockerfile_parser_reads_continued_lines_and_skips_the_wheel():
    text = ('FROM a AS build\nRUN pip install "numpy>=1"\nFROM b\n'
            'RUN pip install --no-deps /wheels/*.whl \\\n && pip install "kopf>=1.37" httpx \\\n'
            ' && rm -rf /wheels\n')
    assert [r.name for r in pip_requirements(text)] == ["kopf", "httpx"]
