"""The PDDeployment API (baton.dev/v1alpha1): models, validation and CRD generation."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .models import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    Condition,
    ConversionStatus,
    PDDeployment,
    PDDeploymentSpec,
    PDDeploymentStatus,
    PoolStatus,
    Role,
)

__all__ = [
    "GROUP", "KIND", "PLURAL", "VERSION", "Condition", "ConversionStatus", "PDDeployment",
    "PDDeploymentSpec", "PDDeploymentStatus", "PoolStatus", "Role", "SpecProblem",
    "parse_spec", "describe_errors",
]


class SpecProblem(ValueError):
    """A spec the operator refuses; `fields` name the offending JSON paths."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        self.fields = [path for path, _ in problems]
        super().__init__("; ".join(f"{path}: {message}" for path, message in problems))


def describe_errors(error: ValidationError, prefix: str = "spec") -> list[tuple[str, str]]:
    """(JSON path, message) for each pydantic error, using the wire (camelCase) names."""
    problems: list[tuple[str, str]] = []
    for item in error.errors():
        parts = [prefix, *(str(p) for p in item["loc"])]
        field = (item.get("ctx") or {}).get("field")
        if item["type"] == "cel" and field:  # a cross-field rule blames one field
            parts.append(field)
        path = ".".join(parts).replace(".[", "[")
        problems.append((path, item["msg"]))
    return problems


def parse_spec(raw: dict[str, Any] | None) -> PDDeploymentSpec:
    """Validate a spec as the API server would (schema and CEL rules); raise SpecProblem."""
    try:
        return PDDeploymentSpec.model_validate(raw or {})
    except ValidationError as error:
        raise SpecProblem(describe_errors(error)) from None
