"""The deadline budget: a request's deadline, every margin taken off it, and every rule that ends a request
for lack of time, in one place (docs/admission.md, "The deadline budget", reproduces `BUDGET_TABLE`, and a
test holds the two equal).

A request's deadline is set once, when its call reaches the data plane (`deadline`): the earlier of the
transport's deadline and `parameters["timeout"]`, else `router.default_timeout_s`, and never further than
`router.max_timeout_s`. A request may only shorten the server's limit (Triton's rule), so an over-long
budget is **clamped**, whichever way it came: an over-long gRPC deadline and an over-long `timeout` are
both cut to `max_timeout_s` (the value is clamped before any arithmetic, so a `timeout` of 2^64-1 µs is
just a long one). Everything after works on that absolute time, and asks this module:

- the data plane's idempotency gate: a call waiting for a running twin waits until the deadline at most;
- admission (`admission_refusal`): refuse what no load could meet (terminal) or the current state cannot
  (retryable); `execution` is the estimate with its margin;
- admission (`latest_start`): when a queued request must have left the queue;
- the batcher (`cut_by`): the last moment to cut a lane's batch;
- the core, while queued (`shed_in_queue`), on arrival (`expired_on_arrival`), on a worker
  (`expired_on_worker`) and when answered (`finished_late`);
- the driver (`wire_budget_us`): what the worker is told is left; the worker adds it to the time the batch
  arrived and skips an item whose budget ran out before its forward (worker/device_thread.py), with no
  margin of its own;
- the data plane, once more before it answers OK (`finished_late`: a cache hit, a replay or the encoding
  may have taken the last of it).

It is pure: times are passed in, nothing is read or kept but the settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sluice_inference.common.errors import DeadlineExceeded, InvalidArgument, SluiceError, Unavailable
from sluice_inference.common.serving_settings import AdmissionSettings, RouterSettings

BATCHES_AHEAD: Final = 2
"""A queued request may ride in a full batch, and its worker may hold one more full batch ahead of it."""
MIN_RESERVE_S: Final = 0.002
RESERVE_FRACTION: Final = 0.1
"""Share of a request's budget kept for the answer's way back: transport and the client's own event loop
(with 5 % a loaded generator still read a few answers after their deadline)."""
MIN_WIRE_BUDGET_US: Final = 1
MAX_WIRE_BUDGET_US: Final = 2**63 - 1
"""An item's budget is an int64 on the wire; 0 would mean "none"."""

BUDGET_TABLE: Final = f"""\
| stage | the rule (deadline = D, arrival = A, now = T, t(n) the estimate for n rows) | margin | outcome |
|---|---|---|---|
| arrival (`deadline`) | D = A + min(gRPC deadline, `parameters["timeout"]`), else \
`router.default_timeout_s`; never past `router.max_timeout_s` | an over-long gRPC deadline or \
`timeout` is clamped | — |
| arrival (`expired_on_arrival`) | D ≤ T | none | DEADLINE_EXCEEDED `expired_on_arrival` |
| idempotency wait | a call whose key names one still running waits for it until D at most | none | \
DEADLINE_EXCEEDED `idempotency_wait` |
| admission (`admission_refusal`) | D - A < best(n), unless the router's CPU is short | none | \
INVALID_ARGUMENT `deadline_too_short` (CPU short: the retryable refusal below) |
| admission (`admission_refusal`) | D - T < t(n)·m, or < t(n)·m + queue wait | m = \
`admission.estimate_margin` | UNAVAILABLE `deadline_unmeetable_now` |
| latest start (`latest_start`) | L = D - {BATCHES_AHEAD}·t(full)·m - max({MIN_RESERVE_S * 1000:g} ms, \
{RESERVE_FRACTION:.0%} of D - A); if that has passed, D - t(n)·m; never past D | {BATCHES_AHEAD} full \
batches, the reserve | — |
| batch cut (`cut_by`) | a lane's batch is cut by L - (t(full) - t(1)) of its most urgent request | \
the batch growing to full | cut `deadline` |
| queued (`shed_in_queue`) | still queued at L | — | UNAVAILABLE `deadline_unmeetable` (D ahead), \
DEADLINE_EXCEEDED `expired_in_queue` (D passed) |
| wire (`wire_budget_us`) | D - T at the send, in µs, within {MIN_WIRE_BUDGET_US}..2^63-1 | none | — |
| worker | skips an item whose budget ran out before its forward (arrival at the worker + budget) | none \
| DEADLINE_EXCEEDED |
| on a worker (`expired_on_worker`) | not answered by D | none | DEADLINE_EXCEEDED `expired_on_worker`, \
the worker drops it |
| answered (`finished_late`) | answered after D (the core, and the data plane once more before OK) | none \
| DEADLINE_EXCEEDED `finished_late` |
"""


@dataclass(frozen=True)
class DeadlineBudget:
    """The deadline rules of one router, with the settings they read."""

    default_s: float = 30.0
    """`router.default_timeout_s`: the budget of a request that names none."""
    longest_s: float = 300.0
    """`router.max_timeout_s`: the longest budget a request may have."""
    estimate_margin: float = 1.2
    """`admission.estimate_margin`: the factor on learned execution estimates."""

    @classmethod
    def of(cls, router: RouterSettings, admission: AdmissionSettings | None = None) -> DeadlineBudget:
        """The budget these settings define (`admission` None: its default margin)."""
        margin = (admission or AdmissionSettings()).estimate_margin
        return cls(router.default_timeout_s, router.max_timeout_s, margin)

    # -- arrival -------------------------------------------------------------------------------------------
    def deadline(self, now: float, transport_s: float | None, timeout_s: float | None) -> float:
        """The request's deadline: the earlier of the transport's and `timeout`, else the default; clamped
        to `longest_s` (a request may only shorten the server's limit)."""
        budgets = [t for t in (transport_s, timeout_s) if t is not None]
        return now + min(*(budgets or [self.default_s]), self.longest_s)

    @staticmethod
    def expired_on_arrival(deadline: float, now: float) -> DeadlineExceeded | None:
        """The error of a request whose deadline passed before it reached the core."""
        if deadline > now:
            return None
        return DeadlineExceeded("deadline already passed on arrival", reason="expired_on_arrival")

    # -- admission -----------------------------------------------------------------------------------------
    def execution(self, seconds: float) -> float:
        """An execution estimate with the safety margin (load inflates estimates)."""
        return seconds * self.estimate_margin

    def admission_refusal(
        self,
        *,
        deadline: float,
        arrival: float,
        now: float,
        best: float,
        execution: float,
        wait: float,
        rows: int,
        terminal: bool = True,
    ) -> SluiceError | None:
        """Why admission refuses a request now, if it does: a budget no load could meet (terminal), or one
        the current state cannot (retryable, hinted by the wait). `execution` is with its margin.
        `terminal` False (the router's CPU is short): a call may then wait in gRPC's queue before the
        router's code runs, a wait its transport deadline already paid and `arrival` does not see, so a
        short budget may be the router's doing and is refused as retryable, never as the client's error
        (at 1,400 req/s with 50 ms deadlines, ~1 % of calls came in with under 3 ms left)."""
        given = deadline - arrival
        if given < best and terminal:
            return InvalidArgument(
                f"deadline of {given * 1000:.1f} ms is shorter than the model's best-case service time "
                f"(~{best * 1000:.1f} ms for {rows} row(s)): no load could meet it",
                reason="deadline_too_short",
            )
        left = deadline - now
        if left < execution:
            spent = now - arrival
            return Unavailable(
                f"{left * 1000:.1f} ms left of a {given * 1000:.1f} ms deadline "
                f"({spent * 1000:.1f} ms spent in the router) cannot cover ~{execution * 1000:.1f} ms "
                f"execution at the current load (best case ~{best * 1000:.1f} ms)",
                reason="deadline_unmeetable_now",
                retry_after_s=max(wait, execution),
            )
        if left < execution + wait:
            return Unavailable(
                f"deadline of {left * 1000:.1f} ms cannot be met at the current load "
                f"(~{wait * 1000:.1f} ms queue + ~{execution * 1000:.1f} ms execution)",
                reason="deadline_unmeetable_now",
                retry_after_s=wait,
            )
        return None

    def latest_start(
        self, *, deadline: float, arrival: float, now: float, full_s: float, execution: float
    ) -> float:
        """When the request must leave the queue: it may ride in a full batch and a worker may hold one more
        full batch ahead of it (`BATCHES_AHEAD`), so budget for both, and keep a reserve for the answer's
        way back — unless only an immediate start can make the deadline. (Budgeting only its own rows let
        the simulator's overloaded workers finish 3-7 % of requests after their deadline.)"""
        reserve = max(MIN_RESERVE_S, RESERVE_FRACTION * (deadline - arrival))
        conservative = deadline - BATCHES_AHEAD * full_s * self.estimate_margin - reserve
        return conservative if conservative > now else deadline - execution

    # -- queued, dispatched, answered ----------------------------------------------------------------------
    @staticmethod
    def cut_by(latest_start: float, full_s: float, one_s: float) -> float:
        """The last moment to cut a lane's batch so its most urgent request (latest start `latest_start`)
        still makes it: a batch that grows to full takes t(full) - t(1) longer than its own row."""
        return latest_start - (full_s - one_s)

    @staticmethod
    def shed_in_queue(deadline: float, now: float, retry_after_s: float) -> SluiceError:
        """The error of a request still queued at its latest start (`retry_after_s`: its lane's drain
        time)."""
        if now >= deadline:
            return DeadlineExceeded("deadline passed while queued", reason="expired_in_queue")
        return Unavailable(
            f"shed before its deadline: {(deadline - now) * 1000:.1f} ms left is less than the "
            "estimated time to run it",
            reason="deadline_unmeetable",
            retry_after_s=retry_after_s,
        )

    @staticmethod
    def wire_budget_us(deadline: float, now: float) -> int:
        """What is left of the budget when a batch is sent, in whole µs for the wire (at least 1: 0 would
        mean "no budget")."""
        return min(MAX_WIRE_BUDGET_US, max(MIN_WIRE_BUDGET_US, round((deadline - now) * 1e6)))

    @staticmethod
    def expired_on_worker() -> DeadlineExceeded:
        """The error of a dispatched request its worker had not answered by the deadline."""
        return DeadlineExceeded("deadline passed before the worker answered", reason="expired_on_worker")

    @staticmethod
    def finished_late(deadline: float, now: float) -> DeadlineExceeded | None:
        """The error of an answer ready only after the deadline: never OK after it."""
        if now <= deadline:
            return None
        return DeadlineExceeded("the answer was ready only after the deadline", reason="finished_late")
