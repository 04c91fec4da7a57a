"""Validate rendered objects offline against published schemas, strictly: an unknown field is an error.

Why strict: most manifest mistakes are a misspelled or misplaced field that the API server would drop
or reject at apply time, far from the test that could have said so.

- Built-in kinds: the Kubernetes OpenAPI schemas bundled by `kubernetes-validate` (its `-strict`
  variants forbid unknown fields), for the oldest and the newest Kubernetes release deploy/ supports.
- CRDs (ServiceMonitor, PrometheusRule, ScaledObject, cert-manager's Certificate and Issuer): no schema
  ships with Kubernetes. The `cloudcoil-models-prometheus-operator`, `cloudcoil-models-keda` and
  `cloudcoil-models-cert-manager` wheels carry pydantic models
  generated from the upstream CRDs; their JSON schema, closed against unknown fields, is the CRD's
  structural schema. Any other kind has no schema and is reported, so nothing passes unchecked.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]

from tests.deploy.rendering import Obj, ref

# The oldest Kubernetes release deploy/ supports (docs/kubernetes.md) and the newest whose schemas
# kubernetes-validate bundles: an API removed in between fails one of them.
KUBERNETES_VERSIONS = ("1.29", "1.37")

# (apiVersion, kind) -> (module, class) of the cloudcoil model generated from that CRD.
CRD_MODELS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (
        "cloudcoil.models.prometheus_operator.v1",
        "ServiceMonitor",
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): (
        "cloudcoil.models.prometheus_operator.v1",
        "PrometheusRule",
    ),
    ("keda.sh/v1alpha1", "ScaledObject"): ("cloudcoil.models.keda.v1alpha1", "ScaledObject"),
    ("cert-manager.io/v1", "Certificate"): ("cloudcoil.models.cert_manager.v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"): ("cloudcoil.models.cert_manager.v1", "Issuer"),
}


# Keywords whose value maps names to schemas (the map itself is not a schema), and keywords holding data.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_DATA_KEYWORDS = frozenset({"default", "examples", "const", "enum"})


def problems(obj: Obj) -> list[str]:
    """Why this object would not pass its schema; empty when it does."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key in CRD_MODELS:
        return _crd_problems(obj, key)
    return [p for version in KUBERNETES_VERSIONS for p in _builtin_problems(obj, version)]


def _builtin_problems(obj: Obj, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = ".".join(str(p) for p in err.path) or "(top level)"
        return [f"{ref(obj)}: Kubernetes {version}: {path}: {err.message}"]
    except kubernetes_validate.SchemaNotFoundError as err:
        return [f"{ref(obj)}: Kubernetes {version}: no schema: {err.message}"]
    return []


def _crd_problems(obj: Obj, key: tuple[str, str]) -> list[str]:
    validator = _crd_validator(*key)
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path)))
    return [f"{ref(obj)}: {e.json_path}: {e.message}" for e in errors]


@functools.cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    module_name, class_name = CRD_MODELS[(api_version, kind)]
    # Imported by name, not statically: mypy would otherwise type-check megabytes of generated models.
    model: Any = getattr(importlib.import_module(module_name), class_name)
    schema = closed(model.model_json_schema(by_alias=True, mode="validation"))
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator_class.check_schema(schema)
    validator: jsonschema.protocols.Validator = validator_class(schema)
    return validator


def closed(schema: Any) -> Any:
    """A copy of a JSON schema in which every object with declared properties forbids any other.

    pydantic's schemas leave objects open (the models ignore unknown fields); CRD structural schemas
    prune unknown fields, which for a manifest author means the setting silently does nothing. Patterns
    are carried over from the CRDs' Go regular expressions into Python's dialect.
    """
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            result[key] = python_regex(value)
        elif key in _DATA_KEYWORDS:
            result[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            result[key] = {name: closed(sub) for name, sub in value.items()}
        else:
            result[key] = closed(value)
    if "properties" in result and "additionalProperties" not in result:
        result["additionalProperties"] = False
    return result


def python_regex(pattern: str) -> str:
    """A Go (RE2) pattern in Python's dialect: Go allows inline flags anywhere (`^(?i)abort$`), Python only
    at the start."""
    flags = re.findall(r"\(\?[a-zA-Z]+\)", pattern)
    if not flags:
        return pattern
    return "".join(flags) + re.sub(r"\(\?[a-zA-Z]+\)", "", pattern)
