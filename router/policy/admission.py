"""Admission: decide before any scarce work is spent whether a request may queue at all.

Checks, in order (each failure is explicit, typed and carries the right retry semantics, docs/design.md §5):
1. quotas — this router's share of the tenant's in-flight cap, the tenant's token bucket, the global
   bucket → RESOURCE_EXHAUSTED with the time until a token (or a slot) frees up;
2. the deadline budget — terminal only when no load could meet it: the whole budget the client gave
   (deadline - arrival) below the model's best-case time for its rows (estimators.py `BestCase`: the
   fastest seen, no margin) → INVALID_ARGUMENT `deadline_too_short` (never retry as is). Anything else
   that makes it infeasible now is the current state's doing, so retryable → UNAVAILABLE
   `deadline_unmeetable_now`: what is left (deadline - now, after the router's own delays) below the
   learned execution estimate times `estimate_margin` (an estimate load inflates), hint the larger of the
   queue wait and that estimate; or below the estimate plus the queue wait, hint the queue wait;
3. queue bounds, in the core's queues — evict less important work or refuse (UNAVAILABLE, drain-time
   hint).
An admitted request gets its `latest_start` = deadline - estimated execution time (minus one full batch
the worker may be running ahead of it, when the budget allows); the core sheds it with UNAVAILABLE
if it is still queued then, rather than executing it late.

With admission disabled (`admission.enabled: false`) every check is skipped and queues are unbounded: the
baseline our overload figures compare against.
"""

from __future__ import annotations

from collections.abc import Mapping

from sluice_inference.common.config import AdmissionSettings, TenantSettings
from sluice_inference.common.errors import InvalidArgument, Unavailable
from sluice_inference.router.policy.backlog import Backlog
from sluice_inference.router.policy.demand import Demand, DemandMeter, changed, publish_interval_s
from sluice_inference.router.policy.estimators import ServiceEstimates
from sluice_inference.router.policy.lanes import LaneLimits, QueuedRequest
from sluice_inference.router.policy.queues import QueueBounds
from sluice_inference.router.policy.ratelimit import Quota, RateLimiter
from sluice_inference.router.policy.shares import ShareBook

AUDIT_TENANT = "__audit__"
"""Internal tenant of cache audits: unlimited quota, lowest priority (router/auditor.py)."""
AUDIT_PRIORITY = 1_000_000
"""Lower than any real priority, so audits wait behind everything and are shed first."""

MIN_RESERVE_S = 0.002
RESERVE_FRACTION = 0.1
"""Share of a request's budget kept for the answer's way back: transport and the client's own event loop
(with 5 % a loaded generator still read a few answers after their deadline)."""


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
        glob = Quota(settings.global_rate, settings.global_burst) if settings.global_rate else None
        self.limiter = RateLimiter(_quotas(tenants), glob, now)
        self.demand = DemandMeter(settings.demand_window_s)
        self.book = ShareBook(
            follow_demand=settings.quota_shares == "demand",
            floor=settings.share_floor,
            max_routers=settings.max_routers,
        )

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

    def execution_seconds(self, request: QueuedRequest, estimates: ServiceEstimates) -> float:
        """Estimated execution time of the request's batch, with the safety margin."""
        key = request.lane
        seconds = estimates.batch_seconds(key.model, key.version, request.rows, shape=key.shape)
        return seconds * self.settings.estimate_margin

    @staticmethod
    def queue_wait_seconds(request: QueuedRequest, backlog: Backlog, full_s: float) -> float:
        """Estimated wait before the request's batch can start, at its priority, under current load
        (other routers' batches on the workers included: they make the workers full, and then one full
        batch, `full_s`, runs before it)."""
        ahead, busy = backlog.rows_ahead, backlog.workers_full
        if not ahead and not busy:
            return 0.0
        wait = backlog.drain_seconds(request.lane, ahead) if ahead else 0.0
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
        key, estimates = request.lane, backlog.estimates
        execution = self.execution_seconds(request, estimates)
        if request.tenant != AUDIT_TENANT:
            self.demand.note(request.tenant, now)
        self.limiter.acquire(request.tenant, now, busy_retry_s=execution)
        # The full batch's time, asked once: the queue wait and the latest start both budget for it.
        full = estimates.batch_seconds(key.model, key.version, limits.max_batch_size, shape=key.shape)
        try:
            self._check_deadline(request, execution, now, backlog, full)
        except BaseException:
            self.limiter.release(request.tenant)
            raise
        request.admitted = True
        request.latest_start = self._latest_start(request, full, execution, now)

    def charge(self, tenant: str, now: float) -> None:
        """A request answered without the queue (a cache hit) pays its tenant's rate like one admitted:
        one token of the tenant's bucket and of the global one, or RESOURCE_EXHAUSTED (nothing taken);
        its demand counts like any arrival's."""
        if not self.settings.enabled:
            return
        self.demand.note(tenant, now)
        self.limiter.take(tenant, now)

    def _latest_start(self, request: QueuedRequest, full: float, execution: float, now: float) -> float:
        """When the request must leave the queue: it may ride in a full batch and a worker may hold one more
        full batch ahead of it (two in flight), so budget for both, and keep a reserve for the answer's way
        back — unless only an immediate start can make the deadline. (Budgeting only its own rows let the
        simulator's overloaded workers finish 3-7 % of requests after their deadline.)"""
        reserve = max(MIN_RESERVE_S, RESERVE_FRACTION * (request.deadline - request.arrival))
        conservative = request.deadline - 2 * full * self.settings.estimate_margin - reserve
        return conservative if conservative > now else request.deadline - execution

    def _check_deadline(
        self, request: QueuedRequest, execution: float, now: float, backlog: Backlog, full: float
    ) -> None:
        """Refuse a deadline no load could meet (terminal), or one the current state cannot (retryable)."""
        key = request.lane
        given = request.deadline - request.arrival
        best = backlog.estimates.best_case_seconds(key.model, key.version, request.rows)
        if given < best:
            raise InvalidArgument(
                f"deadline of {given * 1000:.1f} ms is shorter than the model's best-case service time "
                f"(~{best * 1000:.1f} ms for {request.rows} row(s)): no load could meet it",
                reason="deadline_too_short",
            )
        budget = request.deadline - now
        wait = self.queue_wait_seconds(request, backlog, full)
        if budget < execution:
            spent = now - request.arrival
            raise Unavailable(
                f"{budget * 1000:.1f} ms left of a {given * 1000:.1f} ms deadline "
                f"({spent * 1000:.1f} ms spent in the router) cannot cover ~{execution * 1000:.1f} ms "
                f"execution at the current load (best case ~{best * 1000:.1f} ms)",
                reason="deadline_unmeetable_now",
                retry_after_s=max(wait, execution),
            )
        if budget < execution + wait:
            raise Unavailable(
                f"deadline of {budget * 1000:.1f} ms cannot be met at the current load "
                f"(~{wait * 1000:.1f} ms queue + ~{execution * 1000:.1f} ms execution)",
                reason="deadline_unmeetable_now",
                retry_after_s=wait,
            )

    def release(self, request: QueuedRequest) -> None:
        """The request has ended (any outcome): free its in-flight slot, once."""
        if request.admitted:
            request.admitted = False
            self.limiter.release(request.tenant)
