"""A circuit breaker per worker: a worker that keeps failing gets no batches for a while.

A failure is a batch with an item the worker blames on itself (`ItemError.worker_fault`: a device fault,
or a model that fails even its known-good canary) or a stream that broke with batches in flight. Items
that fail on their own inputs are the client's doing and never count, so a client cannot take a worker
out of rotation by sending bad requests. After `THRESHOLD`
consecutive failures the breaker opens for a backoff that doubles each time it reopens (1 s, 2 s, ... up to
`MAX_BACKOFF_S`); when the backoff ends it is half-open: one batch is let through, and its outcome closes
the breaker (success resets the backoff) or reopens it. Without this, least-loaded or expected-completion
choice would keep feeding the fastest-failing worker, which always looks idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

THRESHOLD: Final = 3
FIRST_BACKOFF_S: Final = 1.0
MAX_BACKOFF_S: Final = 30.0


@dataclass
class _State:
    failures: int = 0
    open_until: float = 0.0
    backoff: float = FIRST_BACKOFF_S
    probing: bool = False


class CircuitBreaker:
    """Breaker states of all workers."""

    def __init__(self) -> None:
        self._states: dict[str, _State] = {}

    def allows(self, worker_id: str, now: float) -> bool:
        """Whether the worker may receive a batch now (a half-open breaker admits one probe at a time)."""
        state = self._states.get(worker_id)
        if state is None or state.failures < THRESHOLD:
            return True
        return now >= state.open_until and not state.probing

    def dispatched(self, worker_id: str, now: float) -> None:
        """A batch went to the worker: if its breaker is half-open, that batch is the probe."""
        state = self._states.get(worker_id)
        if state is not None and state.failures >= THRESHOLD and now >= state.open_until:
            state.probing = True

    def success(self, worker_id: str) -> None:
        """The worker answered a batch with at least one success: close and reset."""
        self._states.pop(worker_id, None)

    def failure(self, worker_id: str, now: float) -> None:
        """The worker failed a whole batch (or lost its stream with batches in flight)."""
        state = self._states.setdefault(worker_id, _State())
        state.failures += 1
        state.probing = False
        if state.failures >= THRESHOLD:
            state.open_until = now + state.backoff
            state.backoff = min(MAX_BACKOFF_S, state.backoff * 2)

    def reopens_at(self, worker_id: str) -> float | None:
        """When an open breaker lets a probe through (None if closed)."""
        state = self._states.get(worker_id)
        if state is None or state.failures < THRESHOLD:
            return None
        return state.open_until

    def forget(self, worker_id: str) -> None:
        """The worker is gone."""
        self._states.pop(worker_id, None)
