"""What a router learns from etcd besides workers — which routers share the quotas and the demand each
published (`routers/`), live tenant overrides (`tenants/`) — and what it tells its peers: its own recent
demand, in its `routers/<id>` record.

- Each `routers/<id>` record is `{"addr": ..., "demand": {"tenants": {name: req/s}, "total": req/s}}`,
  bound to that router's lease, so a router's demand vanishes with it: at once on a clean stop (the lease
  is revoked), within the lease TTL if it died. The core turns the peers' demand into this router's quota
  shares (router/policy/shares.py); a record is parsed once per new value, with the core's bounds.
- Publishing: every publish interval the core is asked what to publish (only a material change, at most
  every `admission.demand_publish_s`, stretched with many routers); the record is rewritten under the
  same lease (docs/admission.md gives the cost).
- While this router's registration cannot reach etcd (its keepalive failed) the peers' demand is stale:
  the core is told so and enforces the equal split over the routers last known, until etcd answers again.
- A tenant override is a JSON object of TenantSettings fields met with the tenant's config entry, which is
  its ceiling: an override can revoke keys and tighten limits, never grant (router/policy/overrides.py),
  and cannot create a tenant; a malformed override is logged and ignored, never applied half-way.
- Both prefixes are followed through `follow_prefix`: no value (oversized, not JSON, nested to exhaust
  the parser) and no failure of this module stops following them; `watches` says whether each is being
  applied, and the router's health depends on it (router/status.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from pydantic import ValidationError

from sluice_inference.common.clock import Clock
from sluice_inference.common.etcd import ROUTERS, TENANTS, LeasedKey
from sluice_inference.common.etcd_watch import WatchHealth, decode_json_value, follow_prefix, stop_watch_tasks
from sluice_inference.common.serving_settings import TenantSettings
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.driver import Driver
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.demand import NO_DEMAND, Demand
from sluice_inference.router.policy.overrides import bound_override
from sluice_inference.router.policy.shares import OWN_GRACE_S
from sluice_inference.router.policy.tenants import TenantDirectory

log = logging.getLogger(__name__)


def merge_overrides(
    configured: dict[str, TenantSettings],
    overrides: dict[str, bytes],
    previous: dict[str, TenantSettings] | None = None,
) -> dict[str, TenantSettings]:
    """Configured tenants with each etcd override applied on top, held to the configuration: an override
    only takes away (router/policy/overrides.py), and one for a tenant the configuration does not name is
    refused (it would create a credential). A malformed override is ignored: the tenant keeps what was in
    force before it (`previous`), never a half-applied patch."""
    merged = dict(configured)
    for name, raw in sorted(overrides.items()):
        if name not in configured:
            log.error(
                "ignoring tenant override %r from etcd: no configured tenant has that name, and an override "
                "cannot create one",
                name[:64],
            )
            continue
        try:
            patch = decode_json_value(raw, what=f"tenant override {name!r}")
            if not isinstance(patch, dict):
                raise TypeError("an override must be a JSON object")
            merged[name], loosened = bound_override(configured[name], patch)
        except (ValueError, TypeError, ValidationError) as exc:
            log.error("ignoring tenant override %r from etcd: %s", name[:64], str(exc)[:200])
            kept = (previous or {}).get(name)
            if kept is not None:
                merged[name] = kept
            continue
        if loosened:
            log.warning(
                "tenant override %r from etcd asks for more than the configuration grants (%s): held to the "
                "configuration, the rest applied",
                name[:64],
                ", ".join(loosened),
            )
    return merged


def router_record(addr: str, demand: Demand | None) -> bytes:
    """The value of a router's `routers/<id>` key: its address, and its demand when it publishes one."""
    record: dict[str, object] = {"addr": addr}
    if demand is not None:
        record["demand"] = demand.to_record()
    return json.dumps(record, separators=(",", ":")).encode()


def _demand_in(router: str, raw: bytes) -> Demand:
    """The demand a peer's record carries (none if it carries none or cannot be read)."""
    try:
        record = decode_json_value(raw, what=f"router record {router[:64]!r}")
        return Demand.from_record(record.get("demand")) if isinstance(record, dict) else NO_DEMAND
    except (ValueError, TypeError) as exc:
        log.warning("unreadable router record (%s): counting no demand", str(exc)[:200])
        return NO_DEMAND


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
        clock: Clock,
    ) -> None:
        self._etcd = etcd
        self._clock = clock
        self._configured = configured
        self._require_key = require_api_key
        self._driver = driver
        self._metrics = metrics
        self.directory = TenantDirectory(configured, require_api_key=require_api_key)
        metrics.tenants = frozenset(configured)
        self._in_force = dict(configured)
        self.routers = 1
        self.router_id: str | None = None
        """This router's name in `routers/` (set by `start`): its own record is not a peer's."""
        self._records: dict[str, tuple[bytes, Demand]] = {}
        """Each peer's raw record and the demand read from it (a record is parsed once per value)."""
        self._peers: dict[str, Demand] = {}
        self.stale = False
        """True while this router cannot reach etcd: shares are the equal split."""
        self._tasks: list[asyncio.Task[None]] = []
        self.watches = (WatchHealth("routers"), WatchHealth("tenants"))
        """Whether `routers/` and `tenants/` are being applied (router/status.py turns them into health)."""

    def current_directory(self) -> TenantDirectory:
        """The tenant directory in force now (swapped atomically on reload)."""
        return self.directory

    def start(self, router_id: str, registration: LeasedKey, addr: str) -> None:
        """Follow both prefixes, and publish this router's demand in its `registration` (a record that
        carries `addr`), in the background."""
        self.router_id = router_id
        routers, tenants = self.watches
        self._tasks = [
            asyncio.create_task(self._follow(ROUTERS, self.apply_routers, routers), name="peers-routers"),
            asyncio.create_task(self._follow(TENANTS, self._apply_tenants, tenants), name="peers-tenants"),
            asyncio.create_task(self._publish(registration, addr), name="peers-demand"),
        ]

    async def stop(self) -> None:
        """Stop following (`stop_watch_tasks`: bounded, whatever a task does with its cancel)."""
        await stop_watch_tasks(self._clock, self._tasks, "peers")

    async def _follow(
        self, folder: str, apply: Callable[[dict[str, bytes]], None], health: WatchHealth
    ) -> None:
        await follow_prefix(self._etcd, self._etcd.prefix + folder, apply, health, self._clock)

    @property
    def peers(self) -> dict[str, Demand]:
        """The other live routers and the demand each published, as last read."""
        return self._peers

    def apply_routers(self, snapshot: dict[str, bytes]) -> None:
        """A `routers/` snapshot: count the routers, read the peers' demand (records whose value did not
        change are not parsed again) and hand it to the core unless the view is stale."""
        records = {}
        for name, raw in snapshot.items():
            if name == self.router_id:
                continue
            known = self._records.get(name)
            records[name] = known if known is not None and known[0] == raw else (raw, _demand_in(name, raw))
        self._records = records
        self._peers = {name: demand for name, (_, demand) in records.items()}
        self.routers = len(records) + 1
        self._metrics.routers.set(self.routers)
        if not self.stale:
            self._driver.set_peers(self._peers)

    async def _publish(self, registration: LeasedKey, addr: str) -> None:
        """Publish rounds, every interval the core asks for; the equal split while etcd is out of reach."""
        while True:
            await self._clock.sleep(self._driver.demand_interval_s())
            if not registration.connected:
                if not self.stale:
                    log.warning("etcd unreachable: quotas fall back to the equal split over %d routers",
                                self.routers)  # fmt: skip
                    self.stale = True
                    self._driver.set_peers(None)
                continue
            if self.stale:
                log.warning("etcd reachable again: quota shares follow demand again")
                self.stale = False
                self._driver.set_peers(self._peers)
            demand = self._driver.publish_demand()
            if demand is not None:
                await registration.update(router_record(addr, demand))
                await self._clock.sleep(OWN_GRACE_S)  # the peers' watches deliver it meanwhile
                self._driver.count_published()

    def _apply_tenants(self, snapshot: dict[str, bytes]) -> None:
        merged = merge_overrides(self._configured, snapshot, self._in_force)
        self._in_force = merged
        self.directory = TenantDirectory(merged, require_api_key=self._require_key)
        self._metrics.tenants = frozenset(merged)
        self._driver.set_tenants(merged)
        if snapshot:
            log.info("tenant overrides from etcd applied: %s", ", ".join(sorted(snapshot)))
