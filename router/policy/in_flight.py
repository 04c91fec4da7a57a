"""The in-flight ledger: every batch this router has sent and not yet settled, and when each is overdue.

Invariants: a batch is in the ledger from `add` until `forget`; each of its requests maps to it meanwhile;
`lanes_busy` counts, per lane, the batches of that lane in the ledger (a lane shape with any is busy and
never forgotten: router/policy/shapes.py). The ledger ends nothing itself: `overdue` returns what is due,
and the core ends it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping

from sluice_inference.router.policy.lanes import LaneKey, QueuedRequest
from sluice_inference.router.policy.outcomes import Dispatch


class InFlight:
    """Batches on workers, by id, with their requests and the soonest deadline still ahead of each."""

    def __init__(self) -> None:
        self._batches: dict[int, Dispatch] = {}
        self._item_batch: dict[int, int] = {}
        self._lane_batches: dict[LaneKey, int] = {}
        self._overdue: list[tuple[float, int]] = []
        """(earliest deadline not yet passed, batch id) of batches in flight; stale entries are skipped."""

    @property
    def batches(self) -> Mapping[int, Dispatch]:
        """The batches in flight by id (read-only)."""
        return self._batches

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._batches))

    def get(self, batch_id: int) -> Dispatch | None:
        """The batch, if it is in flight."""
        return self._batches.get(batch_id)

    def add(self, dispatch: Dispatch) -> None:
        """A batch was sent."""
        self._batches[dispatch.batch_id] = dispatch
        self._lane_batches[dispatch.lane] = self._lane_batches.get(dispatch.lane, 0) + 1
        for request in dispatch.requests:
            self._item_batch[request.request_id] = dispatch.batch_id
        # A list, not a generator: one call per batch rather than one per request.
        heapq.heappush(self._overdue, (min([r.deadline for r in dispatch.requests]), dispatch.batch_id))

    def forget(self, dispatch: Dispatch) -> None:
        """The batch is no longer in flight (answered, lost or unsent)."""
        if self._batches.pop(dispatch.batch_id, None) is not None:
            left = self._lane_batches.pop(dispatch.lane) - 1
            if left:
                self._lane_batches[dispatch.lane] = left
        for request in dispatch.requests:
            self._item_batch.pop(request.request_id, None)

    def holding(self, request_id: int) -> Dispatch | None:
        """The batch in flight that carries the request, if any."""
        return self._batches.get(self._item_batch.get(request_id, -1))

    def lane_busy(self, key: LaneKey) -> bool:
        """Whether a batch of the lane is in flight."""
        return key in self._lane_batches

    def lanes_busy(self) -> int:
        """Lanes with a batch in flight."""
        return len(self._lane_batches)

    def overdue(self, now: float) -> list[tuple[Dispatch, list[QueuedRequest]]]:
        """The requests in flight whose deadline has come and that have not ended, by batch, soonest
        first; each batch is watched again for its next deadline."""
        due: list[tuple[Dispatch, list[QueuedRequest]]] = []
        heap = self._overdue
        while heap and (heap[0][0] <= now or heap[0][1] not in self._batches):
            _, batch_id = heapq.heappop(heap)
            dispatch = self._batches.get(batch_id)
            if dispatch is None:
                continue
            late = [r for r in dispatch.requests if not r.ended and r.deadline <= now]
            if late:
                due.append((dispatch, late))
            later = [r.deadline for r in dispatch.requests if not r.ended and r.deadline > now]
            if later:
                heapq.heappush(heap, (min(later), batch_id))
        return due

    def next_overdue(self) -> float | None:
        """When `overdue` next has something to say (None: nothing in flight)."""
        return self._overdue[0][0] if self._overdue else None
