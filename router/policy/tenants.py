"""Tenants: who is calling (API key → tenant), what they may call, and at which priority.

Keys are never stored, only their SHA-256 (`sha256:<hex>`); lookups compare digests in constant time.
Rules (docs/design.md §4, §5):
- a presented key that matches no tenant is UNAUTHENTICATED, always;
- a request without a key is served as the `anonymous` tenant only if one is configured (local mode) and
  keys are not required; otherwise UNAUTHENTICATED;
- a model outside the tenant's globs is PERMISSION_DENIED;
- priority 0 means the tenant's default; a priority better (lower) than the tenant's `max_priority` is
  capped to it, never rejected.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Final

from sluice_inference.common.errors import InvalidArgument, PermissionDenied, Unauthenticated
from sluice_inference.common.serving_settings import ANONYMOUS_TENANT, TenantSettings


def hash_api_key(key: str) -> str:
    """The stored form of an API key: `sha256:<hex>`."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


MAX_REMEMBERED_MODELS: Final = 1024
"""Model names a tenant's verdicts are remembered for; past it they start over (a hostile stream of names
costs glob matching, never memory)."""


@dataclass(frozen=True)
class Tenant:
    """A tenant's resolved settings."""

    name: str
    settings: TenantSettings
    _verdicts: dict[str, bool] = field(default_factory=dict, init=False, repr=False, compare=False)
    """`allows` by model name: the globs are matched once per name, not per request (a tenant is rebuilt
    whenever its settings change, so a verdict never outlives them)."""

    def allows(self, model: str) -> bool:
        """Whether the tenant may call `model`."""
        verdict = self._verdicts.get(model)
        if verdict is None:
            verdict = any(fnmatchcase(model, pattern) for pattern in self.settings.models)
            if len(self._verdicts) >= MAX_REMEMBERED_MODELS:
                self._verdicts.clear()
            self._verdicts[model] = verdict
        return verdict

    def priority(self, requested: int, levels: int) -> int:
        """The effective priority: 0 → default; better than the entitlement → capped. Anything outside
        0..levels is refused, so queue levels and metric labels stay a bounded set."""
        if not 0 <= requested <= levels:
            raise InvalidArgument(
                f'parameters["priority"] must be in 0..{levels}, got {requested}', reason="bad_priority"
            )
        wanted = requested or self.settings.default_priority
        return max(wanted, self.settings.max_priority)


class TenantDirectory:
    """Tenants by name and by key digest; replaced wholesale on config reload or etcd override."""

    def __init__(self, tenants: Mapping[str, TenantSettings], *, require_api_key: bool = False) -> None:
        self._tenants = {name: Tenant(name, settings) for name, settings in tenants.items()}
        self._by_digest = {
            digest: tenant for tenant in self._tenants.values() for digest in tenant.settings.api_keys
        }
        self._require_key = require_api_key

    def names(self) -> list[str]:
        """Configured tenant names (bounded: safe as a metrics label)."""
        return sorted(self._tenants)

    def get(self, name: str) -> Tenant | None:
        """A tenant by name."""
        return self._tenants.get(name)

    def authenticate(self, api_key: str | None) -> Tenant:
        """The tenant owning `api_key`, or the anonymous tenant for key-less requests where allowed."""
        if api_key is None:
            anonymous = self._tenants.get(ANONYMOUS_TENANT)
            if anonymous is None or self._require_key:
                raise Unauthenticated("missing API key (authorization: Bearer <key>)", reason="missing_key")
            return anonymous
        digest = hash_api_key(api_key)
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return tenant
        raise Unauthenticated("unknown API key", reason="unknown_key")

    @staticmethod
    def authorize(tenant: Tenant, model: str) -> None:
        """PERMISSION_DENIED unless the tenant may call `model`."""
        if not tenant.allows(model):
            raise PermissionDenied(
                f"tenant {tenant.name!r} may not call model {model[:128]!r}", reason="model_denied"
            )
