"""Worker-health timers: when a worker holding work counts as hung, and when an open breaker lets a probe
through. Each returns what is due (`hung`, `reopened`) and the core acts on it, as `Lane.pop_late` does.

Invariants: a worker has at most one live hang timer (a newer stamp supersedes older heap entries); a
timer is armed only while the worker holds batches; the breaker (breaker.py) is owned here, once.
"""

from __future__ import annotations

import heapq
from typing import Final

from sluice_inference.router.policy.breaker import CircuitBreaker
from sluice_inference.router.policy.workers import WorkerSlot

HANG_FACTOR: Final = 10.0
"""A worker is hung once it holds work this many times longer than that work was expected to take (and
at least `hang_after_s`): slow devices and noisy estimates stay far below it."""


class WorkerHealth:
    """Hang timers and breaker reopen times of every worker."""

    def __init__(self, hang_after_s: float) -> None:
        self.hang_after_s = hang_after_s
        self.breaker = CircuitBreaker()
        self._stalls: list[tuple[float, str, int]] = []
        """(when a worker holding work counts as hung, worker, stamp) — a newer stamp supersedes."""
        self._stamp: dict[str, int] = {}
        self._reopens: list[tuple[float, str]] = []
        """(when a worker's open breaker lets a probe through, worker)."""

    def watch(self, slot: WorkerSlot) -> None:
        """(Re)arm the hang timer of a worker after it took or answered work."""
        stamp = self._stamp.get(slot.worker_id, 0) + 1
        self._stamp[slot.worker_id] = stamp
        if slot.in_flight_batches:
            at = slot.last_progress + max(self.hang_after_s, HANG_FACTOR * slot.held_s)
            heapq.heappush(self._stalls, (at, slot.worker_id, stamp))

    def forget(self, worker_id: str) -> None:
        """The worker is gone: its hang timer no longer counts."""
        self._stamp.pop(worker_id, None)

    def hung(self, now: float) -> list[str]:
        """Workers whose hang timer has run out, soonest first; their timers are forgotten."""
        due: list[str] = []
        while self._stalls and self._stalls[0][0] <= now:
            _, worker_id, stamp = heapq.heappop(self._stalls)
            if self._stamp.get(worker_id) == stamp:
                del self._stamp[worker_id]
                due.append(worker_id)
        while self._stalls and self._stamp.get(self._stalls[0][1]) != self._stalls[0][2]:
            heapq.heappop(self._stalls)
        return due

    def next_hang(self) -> float | None:
        """When the next live hang timer runs out."""
        return self._stalls[0][0] if self._stalls else None

    def failed(self, worker_id: str, now: float) -> None:
        """A failure the worker blames on itself: counts against its breaker, which may reopen later."""
        self.breaker.failure(worker_id, now)
        reopen = self.breaker.reopens_at(worker_id)
        if reopen is not None and reopen > now:
            heapq.heappush(self._reopens, (reopen, worker_id))

    def reopened(self, now: float) -> list[str]:
        """Workers whose open breaker may let a probe through now."""
        due: list[str] = []
        while self._reopens and self._reopens[0][0] <= now:
            due.append(heapq.heappop(self._reopens)[1])
        return due

    def next_reopen(self) -> float | None:
        """When the next open breaker may let a probe through."""
        return self._reopens[0][0] if self._reopens else None
