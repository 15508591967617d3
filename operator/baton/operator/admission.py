"""What this operator refuses to build even from a valid spec (pure).

A PDDeployment names a folder and an image; whoever may create one must not thereby get a
node's filesystem. A `hostPath` model source is refused unless the operator was started with
`--allow-host-path PREFIX` and the path lies under one of the prefixes.
"""

from __future__ import annotations

import posixpath

from baton.api import PDDeploymentSpec, SpecProblem


def _under(path: str, prefix: str) -> bool:
    prefix = posixpath.normpath(prefix)
    return prefix == "/" or path == prefix or path.startswith(prefix.rstrip("/") + "/")


def host_path_problem(path: str, allowed: tuple[str, ...]) -> str | None:
    """Why `path` may not be mounted from the node (None: it may)."""
    if not allowed:
        return ("hostPath model sources are disabled on this operator (start it with "
                "--allow-host-path PREFIX to allow folders under PREFIX); use source pvc or image")
    if not path.startswith("/") or ".." in path.split("/"):
        return f"hostPath {path!r} must be an absolute path without '..'"
    if not any(_under(posixpath.normpath(path), prefix) for prefix in allowed):
        return f"hostPath {path!r} is outside the folders this operator allows: {list(allowed)}"
    return None


def check_spec(spec: PDDeploymentSpec, allowed_host_paths: tuple[str, ...]) -> None:
    """Raise SpecProblem naming the field when the spec asks for something refused here."""
    if spec.model.source == "hostPath":
        problem = host_path_problem(spec.model.path or "", allowed_host_paths)
        if problem is not None:
            raise SpecProblem([("spec.model.path", problem)])
