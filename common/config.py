"""Typed configuration: one YAML file (`sluice.yaml`), then `SLUICE_*` environment variables, then flags.

Precedence is file < environment < flags. Nested keys use `__` in the environment
(`SLUICE_ROUTER__LISTEN=0.0.0.0:9001`). Validation lives in the models, so a bad value fails at start with
the offending key named (`ConfigError: router.metrics_port: Input should be ...`). Nothing here is read at
import time. The sections are documented field by field where they live: common/trust_settings.py (etcd,
TLS, Redis, the cluster hop) and common/serving_settings.py (router, worker, tenants, admission, cache,
idempotency, autoscaling); common/config_rules.py has what they share.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError, model_validator

from sluice_inference.common.config_rules import Section
from sluice_inference.common.serving_settings import (
    ANONYMOUS_TENANT,
    AdmissionSettings,
    AutoscaleSettings,
    CacheSettings,
    IdempotencySettings,
    RouterSettings,
    TenantSettings,
    WorkerSettings,
)
from sluice_inference.common.trust_settings import ClusterSettings, EtcdSettings, RedisSettings

ENV_PREFIX = "SLUICE_"


class ConfigError(Exception):
    """Configuration that cannot be used; the message names the key."""


class SluiceConfig(Section):
    """The whole `sluice.yaml`."""

    etcd: EtcdSettings = EtcdSettings()
    router: RouterSettings = RouterSettings()
    worker: WorkerSettings = WorkerSettings()
    cluster: ClusterSettings = ClusterSettings()
    admission: AdmissionSettings = AdmissionSettings()
    redis: RedisSettings = RedisSettings()
    cache: CacheSettings = CacheSettings()
    idempotency: IdempotencySettings = IdempotencySettings()
    autoscale: AutoscaleSettings = AutoscaleSettings()
    tenants: dict[str, TenantSettings] = {
        ANONYMOUS_TENANT: TenantSettings(rate=1e9, burst=1_000_000, max_inflight=1_000_000)
    }
    """Tenants by name. The default serves key-less requests (local mode) with no practical quota;
    configuring `tenants:` replaces it, so production configs list exactly who may call."""

    @model_validator(mode="after")
    def _limits_agree(self) -> SluiceConfig:
        levels = self.admission.priority_levels
        for name, tenant in self.tenants.items():
            if tenant.default_priority > levels:
                raise ValueError(
                    f"tenants.{name}.default_priority {tenant.default_priority} is outside "
                    f"admission.priority_levels ({levels})"
                )
        if self.cluster.max_message_bytes < self.router.max_message_bytes:
            raise ValueError(
                "cluster.max_message_bytes must be at least router.max_message_bytes: every request that "
                "a client may send must fit into a batch to a worker"
            )
        return self


ROUTER_BASELINE_BYTES = 128 * 1024 * 1024
"""A router's resident memory with nothing in flight (measured ≈ 70 MB: Python, gRPC, numpy, protobuf)."""


def concurrent_receives(config: SluiceConfig) -> int:
    """Request bodies a router may be receiving at once, before their size is charged to the in-flight
    budget: each configured tenant's `ModelInfer` receive slots and open streams (one message arriving
    each). Calls without a valid key are refused unread, and etcd overrides never add tenants, so the
    configured tenants are all there can be (docs/security.md, "The router's memory adds up")."""
    router = config.router
    return len(config.tenants) * (router.tenant_max_receives + router.tenant_max_streams)


def router_memory_bound(config: SluiceConfig) -> dict[str, int]:
    """The documented upper bound of a router's memory, by component (bytes). Queued inputs are part of
    the in-flight budget; the idempotency table counts only when records are kept in-process (no Redis)."""
    return {
        "baseline": ROUTER_BASELINE_BYTES,
        "in-flight requests": config.router.max_inflight_bytes,
        "receives": concurrent_receives(config) * config.router.max_message_bytes,
        "result cache": config.cache.memory_bytes if config.cache.enabled else 0,
        "idempotency records": 0 if config.redis.url else config.idempotency.max_bytes,
    }


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _env_value(raw: str) -> Any:
    """Lists and objects come as JSON (`SLUICE_ETCD__ENDPOINTS='["a:1","b:2"]'`); the rest stays a string."""
    return json.loads(raw) if raw[:1] in "[{" else raw


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Nested overrides from `SLUICE_SECTION__KEY=value` variables."""
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _env_value(raw)
    return tree


def _format_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"]) or "(top level)"
        lines.append(f"{key}: {item['msg']}")
    return "; ".join(lines)


def load_config(
    path: Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> SluiceConfig:
    """Read the YAML file (if any), apply environment then flag overrides, and validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded
    data = _deep_merge(data, env_overrides(os.environ if environ is None else environ))
    data = _deep_merge(data, overrides or {})
    try:
        return SluiceConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None
