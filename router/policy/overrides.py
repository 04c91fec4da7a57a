"""What a live tenant override from etcd (`tenants/<name>`) may change: it can only take away.

Whoever can write etcd is trusted with no more than the configuration grants (docs/security.md, "An
attacker who can write etcd"). The configured entry of a tenant is the ceiling of every field: an
override is met with it field by field and the stricter value is in force.

- `api_keys`: only keys the configured entry lists, so an override can revoke a key, never add one;
- `rate`, `burst`, `max_inflight`, `weight`: at most the configured value;
- `default_priority`, `max_priority`: never better (numerically lower) than configured;
- `models`: only patterns the configured entry already allows — a pattern it lists, a plain model name
  one of its globs matches, or anything when it lists `*`;
- `admin`: may be turned off, never on.

A field without a rule here cannot be overridden at all (a new TenantSettings field stays out of etcd's
reach until someone decides how it may move). Fields that would loosen are held to the configuration and
reported; the rest applies, so a revocation written together with a forbidden grant still takes effect.
A malformed override (an unknown field, a value of the wrong type or out of range, priorities that
disagree) raises, and the caller keeps what was in force. A tenant the configuration does not name has no
ceiling, so no override can create one (router/peers.py refuses it whole).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase
from typing import Any, Final

from sluice_inference.common.serving_settings import TenantSettings

_GLOB_CHARS: Final = frozenset("*?[")


def _within(pattern: str, allowed: list[str]) -> bool:
    """Whether every model `pattern` matches is already allowed by `allowed` (conservatively: a glob
    other than one listed verbatim counts as wider, unless `*` is listed)."""
    if pattern in allowed or "*" in allowed:
        return True
    return not (_GLOB_CHARS & set(pattern)) and any(fnmatchcase(pattern, glob) for glob in allowed)


def _keys(asked: Any, ceiling: Any) -> Any:
    return [key for key in asked if key in ceiling]


def _models(asked: Any, ceiling: Any) -> Any:
    return [pattern for pattern in asked if _within(pattern, ceiling)]


def _lower(asked: Any, ceiling: Any) -> Any:
    return min(asked, ceiling)


def _worse_priority(asked: Any, ceiling: Any) -> Any:
    return max(asked, ceiling)  # Triton's convention: 1 is the best


def _admin(asked: Any, ceiling: Any) -> Any:
    return bool(asked and ceiling)


RULES: Final[Mapping[str, Callable[[Any, Any], Any]]] = {
    "api_keys": _keys,
    "rate": _lower,
    "burst": _lower,
    "max_inflight": _lower,
    "weight": _lower,
    "default_priority": _worse_priority,
    "max_priority": _worse_priority,
    "models": _models,
    "admin": _admin,
}
"""Each overridable field and how the asked value meets the configured one (module rules)."""


def bound_override(
    configured: TenantSettings, patch: Mapping[str, object]
) -> tuple[TenantSettings, list[str]]:
    """The settings in force when `patch` (an override's JSON object) is written for a configured
    tenant, and the fields of the patch that asked for more than the configuration grants (held to it).
    Raises pydantic's ValidationError (a ValueError) when the patch is malformed."""
    data = {**configured.model_dump(), **patch}
    worse = patch.get("max_priority")
    if "default_priority" not in patch and isinstance(worse, int):
        # A worse max_priority drags the default with it, rather than being refused as inconsistent.
        data["default_priority"] = max(configured.default_priority, worse)
    asked = TenantSettings.model_validate(data)
    bounded: dict[str, Any] = {}
    for field in TenantSettings.model_fields:
        ceiling = getattr(configured, field)
        rule = RULES.get(field)
        bounded[field] = ceiling if rule is None else rule(getattr(asked, field), ceiling)
    loosened = sorted(field for field in patch if bounded[field] != getattr(asked, field))
    return TenantSettings.model_validate(bounded), loosened
