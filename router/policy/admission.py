"""Admission: decide before any scarce work is spent whether a request may queue at all.

Checks, in order (each failure is explicit, typed and carries the right retry semantics, docs/design.md §5):
1. quotas — this router's share of the tenant's in-flight cap, the tenant's token bucket, the global
   bucket → RESOURCE_EXHAUSTED with the time until a token (or a slot) frees up;
2. the deadline budget — terminal only when no load could meet it, else retryable: this module measures
   the request's best case, execution estimate and queue wait, and `DeadlineBudget.admission_refusal`
   (deadline_budget.py, which owns every deadline margin) decides;
3. queue bounds, in the core's queues — evict less important work or refuse (UNAVAILABLE, drain-time
   hint).
An admitted request gets its `latest_start` from `DeadlineBudget.latest_start`; the core sheds it if it is
still queued then, rather than executing it late.

With admission disabled (`admission.enabled: false`) every check is skipped and queues are unbounded: the
baseline our overload figures compare against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from sluice_inference.common.serving_settings import AdmissionSettings, TenantSettings
from sluice_inference.router.policy.backlog import Backlog, drain_time
from sluice_inference.router.policy.deadline_budget import DeadlineBudget
from sluice_inference.router.policy.demand import Demand, DemandMeter, changed, publish_interval_s
from sluice_inference.router.policy.lanes import LaneLimits, QueuedRequest
from sluice_inference.router.policy.queues import QueueBounds
from sluice_inference.router.policy.ratelimit import Quota, RateLimiter
from sluice_inference.router.policy.shares import ShareBook

AUDIT_TENANT: Final = "__audit__"
"""Internal tenant of cache audits: unlimited quota, lowest priority (router/auditor.py)."""
AUDIT_PRIORITY: Final = 1_000_000
"""Lower than any real priority, so audits wait behind everything and are shed first."""


def _quotas(tenants: dict[str, TenantSettings]) -> dict[str, Quota]:
    quotas = {name: Quota(t.rate, t.burst, t.max_inflight) for name, t in tenants.items()}
    quotas[AUDIT_TENANT] = Quota(rate=1e9, burst=10**9)
    return quotas


def queue_bounds(settings: AdmissionSettings) -> QueueBounds | None:
    """The queue bounds for these settings (None: unbounded baseline)."""
    if not settings.enabled:
        return None
    return QueueBounds(settings.lane_max_queued, settings.max_queued_bytes)


class AdmissionController:
    """Quotas and deadline feasibility in front of the queues."""

    def __init__(self, settings: AdmissionSettings, tenants: dict[str, TenantSettings], now: float) -> None:
        self.settings = settings
        self.budget = DeadlineBudget(estimate_margin=settings.estimate_margin)
        """The deadline rules (only its margin is read here)."""
        glob = Quota(settings.global_rate, settings.global_burst) if settings.global_rate else None
        self.limiter = RateLimiter(_quotas(tenants), glob, now)
        self.demand = DemandMeter(settings.demand_window_s)
        self.book = ShareBook(
            follow_demand=settings.quota_shares == "demand",
            floor=settings.share_floor,
            max_routers=settings.max_routers,
        )
        self.router_pressed = False
        """The router's own CPU is short (`RouterCore.host_load`: pressure above 0.5, or calls wait for its
        code): no deadline refusal is terminal then (`DeadlineBudget.admission_refusal`)."""

    def set_tenants(self, tenants: dict[str, TenantSettings], now: float) -> None:
        """Apply reloaded tenant quotas (config reload or etcd `tenants/` overrides)."""
        self.limiter.set_quotas(_quotas(tenants), now)
        self._reshare(now)

    def set_peers(self, peers: Mapping[str, Demand] | None, now: float) -> None:
        """The other live routers and the demand each published (None: unknown now, so the equal split over
        the routers last known); shares follow at once (router/policy/shares.py)."""
        self.book.set_peers(peers)
        self._reshare(now)

    def publish_demand(self, now: float) -> Demand | None:
        """One publish round (the shell runs one every `publish_interval_s`): the demand to publish now if
        it moved materially, else None. Where it fell it counts at once; where it rose, only from
        `count_published`, which the shell calls `OWN_GRACE_S` after writing it."""
        if self.settings.quota_shares != "demand":
            return None
        current = self.demand.current(now).as_published()
        if not changed(self.book.published, current):
            return None
        self.book.publish(current)
        self._reshare(now)
        return current

    def count_published(self, now: float) -> None:
        """The last published demand has reached the peers: count it in full."""
        self.book.promote()
        self._reshare(now)

    def publish_interval_s(self) -> float:
        """How long to wait between two publish rounds (router/policy/demand.py)."""
        return publish_interval_s(self.settings.demand_publish_s, self.book.routers)

    def _reshare(self, now: float) -> None:
        tenants = [name for name in self.limiter.quotas if name != AUDIT_TENANT]
        self.limiter.set_shares(self.book.shares(tenants), now)

    @staticmethod
    def queue_wait_seconds(request: QueuedRequest, backlog: Backlog, full_s: float, full_rows: int) -> float:
        """Estimated wait before the request's batch can start, at its priority, under current load
        (other routers' batches on the workers included: they make the workers full, and then one full
        batch, `full_s` for `full_rows` rows, runs before it)."""
        ahead, busy = backlog.rows_ahead, backlog.workers_full
        if not ahead and not busy:
            return 0.0
        wait = 0.0
        if ahead:
            batch = backlog.batch
            if batch == full_rows:  # the lane's batch is the request's full one: its time is known
                wait = drain_time(full_s, ahead, batch, backlog.workers)
            else:
                wait = backlog.drain_seconds(request.lane, ahead)
        if busy:
            wait += full_s
        return wait

    def admit(self, request: QueuedRequest, limits: LaneLimits, now: float, backlog: Backlog) -> None:
        """Take the request's quota and set its latest start, or raise (nothing taken). `backlog` is what
        its lane holds ahead of it, as numbers (nothing is called back). The caller queues it next, and
        calls `release` once it ends."""
        if not self.settings.enabled:
            request.priority, request.tenant = 1, ""  # the baseline: one plain FIFO, no classes
            return
        # Its batch's time, the full batch's (the queue wait and the latest start both budget for it) and
        # the best case, asked at once.
        seconds, full, best = backlog.estimates.admission_seconds(
            request.lane, request.rows, limits.max_batch_size
        )
        budget, tenant = self.budget, request.tenant
        execution = budget.execution(seconds)
        if tenant != AUDIT_TENANT:
            self.demand.note(tenant, now)
        self.limiter.acquire(tenant, now, busy_retry_s=execution)
        try:
            wait = self.queue_wait_seconds(request, backlog, full, limits.max_batch_size)
            refusal = budget.admission_refusal(
                deadline=request.deadline, arrival=request.arrival, now=now, best=best, execution=execution,
                wait=wait, rows=request.rows, terminal=not self.router_pressed,
            )  # fmt: skip
        except BaseException:
            self.limiter.release(tenant)
            raise
        if refusal is not None:
            self.limiter.release(tenant)
            raise refusal
        request.admitted = True
        request.latest_start = budget.latest_start(
            deadline=request.deadline, arrival=request.arrival, now=now, full_s=full, execution=execution
        )

    def charge(self, tenant: str, now: float) -> None:
        """A request answered without the queue (a cache hit) pays its tenant's rate like one admitted:
        one token of the tenant's bucket and of the global one, or RESOURCE_EXHAUSTED (nothing taken);
        its demand counts like any arrival's."""
        if not self.settings.enabled:
            return
        self.demand.note(tenant, now)
        self.limiter.take(tenant, now)

    def release(self, request: QueuedRequest) -> None:
        """The request has ended (any outcome): free its in-flight slot, once."""
        if request.admitted:
            request.admitted = False
            self.limiter.release(request.tenant)
