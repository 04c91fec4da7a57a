"""The core as the shell may see it: read-only questions and frozen snapshots, nothing that can change it.

Rule: the async shell (status, admin servicer, data plane, driver metrics) asks these questions instead of
reaching into the core's workers, queues, limiter, estimators or breaker, so each answer ("is any worker
accepting", "ready workers per model", "batches in flight") is computed in one place and the core's state
can change shape without touching the shell. Every answer is a number or a frozen value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice_inference.router.policy.lanes import LaneKey
from sluice_inference.router.policy.outcomes import Dispatch
from sluice_inference.router.policy.queues import VersionQueue

if TYPE_CHECKING:
    from sluice_inference.router.policy.core import RouterCore


@dataclass(frozen=True)
class WorkerView:
    """One worker as this router holds it."""

    worker_id: str
    accepting: bool
    """Takes batches from this router now (registered ready, stream up, reported ready)."""
    models: frozenset[tuple[str, str]]
    in_flight_batches: int
    """Batches this router has on it."""


@dataclass(frozen=True)
class LaneView:
    """One non-empty lane."""

    key: LaneKey
    depth: int
    oldest_age_s: float
    arrival_rate: float
    """Rows per second arriving recently."""


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's quota as this router enforces it now."""

    tokens: float
    """Tokens in its bucket (this router's share)."""
    share: float
    """This router's share of the tenant's cluster-wide quota."""


class CoreView:
    """Read-only questions about one `RouterCore` (`core.view`)."""

    def __init__(self, core: RouterCore) -> None:
        self._core = core

    # -- workers ----------------------------------------------------------------------------------------
    def workers(self) -> tuple[WorkerView, ...]:
        """Every worker the core knows, by id."""
        return tuple(
            WorkerView(w.worker_id, w.accepting, w.models, w.in_flight_batches)
            for w in sorted(self._core.workers, key=lambda slot: slot.worker_id)
        )

    def any_accepting(self) -> bool:
        """Whether some worker takes batches now (the router is ready)."""
        return any(w.accepting for w in self._core.workers)

    def accepting_count(self) -> int:
        """Workers that take batches now."""
        return sum(1 for w in self._core.workers if w.accepting)

    def worker_count(self) -> int:
        """Workers the core knows (accepting or not)."""
        return len(self._core.workers)

    def ready_workers(self, model: str) -> int:
        """Accepting workers that serve any version of `model`."""
        return sum(1 for w in self._core.workers if w.accepting and any(m == model for m, _ in w.models))

    def serves(self, model: str, version: str) -> bool:
        """Whether some accepting worker serves this model version."""
        return self._core.serves(model, version)

    def in_flight_on(self, worker_id: str) -> int:
        """Batches this router has on a worker."""
        return self._core.in_flight_on(worker_id)

    def sent(self) -> tuple[int, int]:
        """Batches cut so far and the rows in them (both only grow)."""
        dispatcher = self._core.dispatcher
        return dispatcher.sent_batches, dispatcher.sent_rows

    def in_flight_batches(self) -> int:
        """Batches this router has on all workers."""
        return len(self._core.ledger)

    def dispatch(self, batch_id: int) -> Dispatch | None:
        """The batch, while it is in flight (the same immutable `Dispatch` the core's decision carried)."""
        return self._core.ledger.get(batch_id)

    def breaker_open(self, worker_id: str, now: float) -> bool:
        """Whether the worker's breaker keeps batches from it now."""
        return not self._core.breaker.allows(worker_id, now)

    def shape_state(self) -> dict[str, int]:
        """Entries of each table kept per lane shape (each bounded by the `ShapeTable`'s limit per model)."""
        core = self._core
        return {
            "shapes": len(core.shapes),
            "lanes": len(core.queues.lanes),
            "lane_stats": len(core.queues.stats),
            "lane_limits": len(core.queues.limits),
            "waiting": len(core.planner),
            "lanes_in_flight": core.ledger.lanes_busy(),
            "fits": core.estimates.fits(),
        }

    # -- estimates --------------------------------------------------------------------------------------
    def batch_seconds(self, model: str, version: str, rows: int, worker: str = "") -> float:
        """Expected execution time of a batch of `rows` (on `worker`, or across workers)."""
        return self._core.estimates.batch_seconds(model, version, rows, worker)

    # -- queues -----------------------------------------------------------------------------------------
    def lanes(self, now: float) -> tuple[LaneView, ...]:
        """Non-empty lanes, by key."""
        queues = self._core.queues
        views = []
        for key in sorted(queues.lanes):
            lane = queues.lanes[key]
            oldest = lane.oldest_arrival()
            stats = queues.stats.get(key)
            rate = 0.0 if stats is None else stats.rate(now)
            views.append(LaneView(key, len(lane), 0.0 if oldest is None else now - oldest, rate))
        return tuple(views)

    def queued_by_version(self, now: float) -> dict[tuple[str, str], VersionQueue]:
        """Depth and oldest wait per model version with anything queued."""
        return self._core.queues.by_version(now)

    def queued(self) -> int:
        """Requests waiting in lanes."""
        return self._core.queues.queued()

    def queued_bytes(self) -> int:
        """Input bytes waiting in lanes."""
        return self._core.queues.queued_bytes()

    def arrival_rate(self, model: str, now: float) -> float:
        """Rows per second arriving recently at this router for `model`."""
        return self._core.queues.arrival_rate(model, now)

    # -- quotas -----------------------------------------------------------------------------------------
    def routers(self) -> int:
        """Routers the quotas are split over."""
        return self._core.admission.limiter.routers

    def tenants(self, now: float) -> dict[str, TenantUsage]:
        """Each tenant's bucket level and share; "*" is the global bucket."""
        limiter = self._core.admission.limiter
        usage = {}
        for tenant, level in limiter.levels(now).items():
            share = limiter.shares.cluster if tenant == "*" else limiter.shares.of(tenant)
            usage[tenant] = TenantUsage(level, share)
        return usage

    def inflight(self, tenant: str) -> int:
        """The tenant's requests admitted here and not yet ended."""
        return self._core.admission.limiter.inflight.get(tenant, 0)

    def inflight_cap(self, tenant: str) -> int | None:
        """This router's share of the tenant's in-flight cap (None: uncapped)."""
        return self._core.admission.limiter.inflight_cap(tenant)
