"""Generate the PDDeployment CustomResourceDefinition from the pydantic models.

Pydantic emits JSON Schema 2020-12; the API server wants a *structural* OpenAPI v3 schema:
no $ref, every node typed, `nullable` instead of a null branch, boolean exclusive bounds,
no `additionalProperties: false` next to `properties`. The walk below does that translation
and attaches each model's CEL rules where that model sits in the tree.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from . import models
from .cel import rules_of

# Keys the structural schema keeps; everything else pydantic emits (title, ...) is dropped.
_KEPT = {
    "type", "description", "properties", "required", "items", "additionalProperties", "enum",
    "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "pattern",
    "format", "default",
}


def _models_by_title() -> dict[str, type[BaseModel]]:
    found: dict[str, type[BaseModel]] = {}
    for value in vars(models).values():
        if isinstance(value, type) and issubclass(value, BaseModel) and value is not BaseModel:
            found[value.__name__] = value
    return found


class _Translator:
    def __init__(self, definitions: dict[str, Any]) -> None:
        self.definitions = definitions
        self.models = _models_by_title()

    def node(self, schema: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            merged = {**self.definitions[name], **{k: v for k, v in schema.items() if k != "$ref"}}
            return self.node(merged)
        branches = schema.get("anyOf")
        if branches is not None:
            return self._union(schema, branches)
        out: dict[str, Any] = {}
        if "const" in schema:
            out["type"] = "string"
            out["enum"] = [schema["const"]]
        for key, value in schema.items():
            if key not in _KEPT:
                continue
            if key == "properties":
                out[key] = {name: self.node(sub) for name, sub in value.items()}
            elif key in ("items",):
                out[key] = self.node(value)
            elif key == "additionalProperties":
                if isinstance(value, dict):
                    out[key] = self.node(value)
            elif key == "default":
                default = _structural_default(value)
                if default is not None:
                    out[key] = default
            else:
                out[key] = value
        for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if bound in schema:  # JSON Schema number -> OpenAPI v3 boolean flag
                out[inclusive] = schema[bound]
                out[bound] = True
        if "properties" in out:
            out["type"] = "object"
            required = set(out.get("required", ()))
            for name, sub in out["properties"].items():
                # Optional sub-objects default to {} so the API server fills in their own
                # defaults, and CEL rules may then read e.g. self.autoscaling.enabled safely.
                if sub.get("type") == "object" and name not in required and not sub.get("nullable"):
                    sub.setdefault("default", {})
            model = self.models.get(schema.get("title", ""))
            rules = rules_of(model) if model is not None else ()
            if rules:
                out["x-kubernetes-validations"] = [rule.to_crd() for rule in rules]
        return _ordered(out)

    def _union(self, schema: dict[str, Any], branches: list[dict[str, Any]]) -> dict[str, Any]:
        concrete = [b for b in branches if b.get("type") != "null"]
        nullable = len(concrete) < len(branches)
        types = {b.get("type") for b in concrete}
        if types == {"integer", "string"}:
            out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
        elif len(concrete) == 1:
            out = self.node(concrete[0])
        else:
            raise ValueError(f"cannot express union in a structural schema: {branches}")
        extra = {k: v for k, v in schema.items() if k != "anyOf"}
        out.update(self.node(extra) if extra else {})
        if nullable:
            out["nullable"] = True
            out.pop("default", None)
        return out


_ORDER = ("type", "description", "nullable", "default", "enum", "format", "minimum",
          "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength", "maxLength")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Stable, readable key order: scalars first, then structure, then rules."""
    first = [k for k in _ORDER if k in node]
    rest = [k for k in node if k not in _ORDER]
    return {k: node[k] for k in first + rest}


def _structural_default(value: Any) -> Any:
    """Objects default to {} so the API server fills in their own field defaults."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {}
    return value


def _schema_of(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation", ref_template="#/$defs/{model}")
    definitions = raw.pop("$defs", {})
    return _Translator(definitions).node(raw)


PRINTER_COLUMNS = [
    {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefill.ready",
     "description": "ready prefill workers"},
    {"name": "Decode", "type": "integer", "jsonPath": ".status.decode.ready",
     "description": "ready decode workers"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


# `kubectl scale pdd NAME --replicas N` and a HorizontalPodAutoscaler size the decode pool:
# the one that grows with concurrent streams. With spec.autoscaling.enabled the controller's
# status.target rules instead, so do not point an HPA at an autoscaled PDDeployment.
SCALE = {
    "specReplicasPath": ".spec.decode.replicas",
    "statusReplicasPath": ".status.decode.current",
    "labelSelectorPath": ".status.decode.selector",
}


def build_crd() -> dict[str, Any]:
    spec_schema = _schema_of(models.PDDeploymentSpec)
    status_schema = _schema_of(models.PDDeploymentStatus)
    status_schema["properties"]["conditions"].update(
        {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
    )
    root = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{models.PLURAL}.{models.GROUP}"},
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": list(models.SHORT_NAMES),
                "categories": ["baton"],
            },
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": SCALE},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def open_api_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the served version (what samples are checked against)."""
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
