"""Cross-field rules, written once and used twice.

Each rule carries its CEL text (emitted into the CRD as `x-kubernetes-validations`, so the API
server enforces it) and a Python predicate with the same meaning (run by the pydantic models,
so the operator and the tests enforce exactly the same thing without a CEL interpreter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError


@dataclass(frozen=True)
class CelRule:
    rule: str  # CEL, evaluated by the API server with `self` bound to the object
    message: str
    field: str  # the field blamed, relative to the object (JSON name, e.g. "min")
    holds: Callable[[Any], bool]  # the same rule in Python, given the pydantic model

    def to_crd(self) -> dict[str, str]:
        return {"rule": self.rule, "message": self.message, "fieldPath": f".{self.field}"}


class ApiModel(BaseModel):
    """Base of every API object: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    # Subclasses list their rules in `__cel__` (dunder names are not fields to pydantic).
    __cel__: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> ApiModel:
        for rule in type(self).__dict__.get("__cel__", ()):
            if not rule.holds(self):
                raise PydanticCustomError("cel", rule.message, {"field": rule.field})
        return self


def rules_of(model: type[BaseModel]) -> tuple[CelRule, ...]:
    return tuple(model.__dict__.get("__cel__", ()))
