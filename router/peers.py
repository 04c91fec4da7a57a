"""What a router learns from etcd besides workers: how many routers share the quotas (`routers/`), and
live tenant overrides (`tenants/`).

Quota shares follow the router count the moment a router registers or its key disappears (revoked on a
clean stop; after the lease TTL if it died), see docs/admission.md. A tenant override is a JSON object of
TenantSettings fields merged over the tenant's config entry (or a whole new tenant); a malformed override
is logged and ignored, never applied half-way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

from pydantic import ValidationError

from common.config import EtcdSettings, TenantSettings
from common.etcd import ROUTERS, TENANTS
from common.etcd_watch import watch_prefix_snapshots
from router.driver import Driver
from router.metrics import RouterMetrics
from router.policy.tenants import TenantDirectory

log = logging.getLogger(__name__)


def merge_overrides(
    configured: dict[str, TenantSettings],
    overrides: dict[str, bytes],
    previous: dict[str, TenantSettings] | None = None,
) -> dict[str, TenantSettings]:
    """Configured tenants with each valid etcd override applied on top. An invalid override is ignored:
    the tenant keeps what was in force before it (`previous`), never a half-applied patch."""
    merged = dict(configured)
    for name, raw in sorted(overrides.items()):
        try:
            patch = json.loads(raw)
            if not isinstance(patch, dict):
                raise TypeError("an override must be a JSON object")
            base = configured[name].model_dump() if name in configured else {}
            merged[name] = TenantSettings.model_validate({**base, **patch})
        except (ValueError, TypeError, ValidationError) as exc:
            log.error("ignoring tenant override %r from etcd: %s", name, exc)
            kept = (previous or {}).get(name)
            if kept is not None:
                merged[name] = kept
    return merged


class PeerView:
    """Follows `routers/` and `tenants/` and applies them to the driver and the tenant directory."""

    def __init__(
        self,
        etcd: EtcdSettings,
        configured: dict[str, TenantSettings],
        *,
        require_api_key: bool,
        driver: Driver,
        metrics: RouterMetrics,
    ) -> None:
        self._etcd = etcd
        self._configured = configured
        self._require_key = require_api_key
        self._driver = driver
        self._metrics = metrics
        self.directory = TenantDirectory(configured, require_api_key=require_api_key)
        metrics.tenants = frozenset(configured)
        self._in_force = dict(configured)
        self.routers = 1
        self._tasks: list[asyncio.Task[None]] = []

    def current_directory(self) -> TenantDirectory:
        """The tenant directory in force now (swapped atomically on reload)."""
        return self.directory

    def start(self) -> None:
        """Follow both prefixes in the background."""
        self._tasks = [
            asyncio.create_task(self._follow(ROUTERS, self._apply_routers), name="peers-routers"),
            asyncio.create_task(self._follow(TENANTS, self._apply_tenants), name="peers-tenants"),
        ]

    async def stop(self) -> None:
        """Stop following."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _follow(self, folder: str, apply: Callable[[dict[str, bytes]], None]) -> None:
        snapshots = watch_prefix_snapshots(self._etcd, self._etcd.prefix + folder)
        async with contextlib.aclosing(snapshots):
            async for snapshot in snapshots:
                apply(snapshot)

    def _apply_routers(self, snapshot: dict[str, bytes]) -> None:
        self.routers = max(1, len(snapshot))
        self._driver.set_routers(self.routers)
        self._metrics.routers.set(self.routers)

    def _apply_tenants(self, snapshot: dict[str, bytes]) -> None:
        merged = merge_overrides(self._configured, snapshot, self._in_force)
        self._in_force = merged
        self.directory = TenantDirectory(merged, require_api_key=self._require_key)
        self._metrics.tenants = frozenset(merged)
        self._driver.set_tenants(merged)
        if snapshot:
            log.info("tenant overrides from etcd applied: %s", ", ".join(sorted(snapshot)))
