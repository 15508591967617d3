"""What the API server does to a custom resource before storing it, with real rule engines.

1. Defaulting from the CRD's structural schema (`default`, applied top-down).
2. The OpenAPI v3 schema (types, enums, bounds, required; unknown fields refused, as
   kubectl's default `fieldValidation=Strict` asks), checked by jsonschema.
3. Every `x-kubernetes-validations` rule, compiled and run by cel-python, a CEL
   implementation, with `self` typed by the schema as Kubernetes types it (a `number` field
   is a CEL double even when the JSON holds an integer).

Pure functions; `validate` raises ValueError with the messages the API server would give.
"""

from __future__ import annotations

import copy
import functools
from typing import Any


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """A copy of `value` with the schema's defaults filled in (objects and array items)."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(value[name], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in list(value):
                if key not in (schema.get("properties") or {}):
                    value[key] = apply_defaults(value[key], extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(item, schema["items"]) for item in value]
    return value


def _jsonschema(schema: Any, strict: bool) -> Any:
    """The schema as jsonschema reads it, Kubernetes keys dropped; strict: unknown fields
    refused (kubectl's fieldValidation=Strict), else they would be pruned, not refused."""
    if isinstance(schema, list):
        return [_jsonschema(s, strict) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _jsonschema(v, strict) for k, v in schema.items() if not k.startswith("x-kubernetes-")
           and k not in ("nullable", "default", "description")}
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if schema.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if (strict and "properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def schema_errors(obj: dict[str, Any], schema: dict[str, Any], strict: bool = True) -> list[str]:
    import jsonschema

    checked = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    top = copy.deepcopy(schema)
    for name in ("apiVersion", "kind", "metadata"):
        (top.get("properties") or {}).pop(name, None)
    validator = jsonschema.Draft4Validator(_jsonschema(top, strict))
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in validator.iter_errors(checked)]


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    from celpy import celtypes

    kind = schema.get("type")
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if kind == "number" and isinstance(value, int | float):
        return celtypes.DoubleType(float(value))
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    if isinstance(value, list):
        return celtypes.ListType([to_cel(v, schema.get("items") or {}) for v in value])
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(
            schema.get("additionalProperties"), dict) else {}
        return celtypes.MapType({celtypes.StringType(k): to_cel(v, props.get(k, extra))
                                 for k, v in value.items()})
    return value


@functools.cache
def _program(rule: str) -> Any:
    import celpy

    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every (path, rule) in the schema, so each can be compiled up front."""
    out = [(path, r) for r in schema.get("x-kubernetes-validations") or []]
    for name, sub in (schema.get("properties") or {}).items():
        out += rules(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        out += rules(schema["items"], f"{path}[]")
    return out


def compile_rules(schema: dict[str, Any]) -> int:
    """Compile every rule (raises on a rule CEL cannot parse); returns how many there are."""
    found = rules(schema)
    for _, rule in found:
        _program(rule["rule"])
    return len(found)


def cel_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    out = []
    for rule in schema.get("x-kubernetes-validations") or []:
        try:
            holds = bool(_program(rule["rule"]).evaluate({"self": to_cel(value, schema)}))
        except Exception as e:  # an evaluation error refuses the object, as on a cluster
            out.append(f"{path or '<root>'}: {rule['rule']}: {e}")
            continue
        if not holds:
            out.append(f"{path}{rule.get('fieldPath', '')}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                out += cel_errors(value[name], sub, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += cel_errors(item, schema["items"], f"{path}[{i}]")
    return out


def validate(obj: dict[str, Any], schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """The defaulted object, or ValueError listing every schema and CEL refusal."""
    defaulted = apply_defaults(obj, schema)
    problems = schema_errors(defaulted, schema, strict)
    if not problems:  # CEL runs on objects that passed the schema, as on a cluster
        problems = cel_errors({k: v for k, v in defaulted.items()
                               if k not in ("apiVersion", "kind", "metadata")},
                              {**schema, "x-kubernetes-validations": schema.get(
                                  "x-kubernetes-validations", [])})
    if problems:
        raise ValueError("; ".join(problems))
    return defaulted
