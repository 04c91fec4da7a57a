"""Fakes of the router core's seams, in one place: a core with learned estimates, workers, requests, and
answers built the way a worker would send them."""

from __future__ import annotations

import itertools

from sluice_inference.common.errors import Code, SluiceError
from sluice_inference.common.serving_settings import AdmissionSettings, RouterSettings, TenantSettings
from sluice_inference.router.policy.batcher import Batcher, TimerBatcher
from sluice_inference.router.policy.core import RouterCore
from sluice_inference.router.policy.lanes import LaneKey, LaneLimits, QueuedRequest
from sluice_inference.router.policy.outcomes import BatchAnswer, Decision, Dispatch, ItemAnswer, Served
from sluice_inference.router.policy.scheduler import Chooser, LeastLoaded

KEY = LaneKey("m", "1")
LIMITS = LaneLimits(max_batch_size=4, max_wait_s=0.002)
TENANTS = {"gold": TenantSettings(rate=1e6, burst=10**6), "bronze": TenantSettings(rate=1e6, burst=10**6)}
_ids = itertools.count(1)


def make_core(
    *,
    admission: AdmissionSettings | None = None,
    settings: RouterSettings | None = None,
    batcher: Batcher | None = None,
    chooser: Chooser | None = None,
    max_batch_bytes: int | None = None,
) -> RouterCore:
    """A core whose estimates learned t(n) = 10 ms + 1 ms·n for model m:1 (from "worker answers")."""
    core = RouterCore(
        0.0,
        settings=settings or RouterSettings(),
        admission=admission or AdmissionSettings(estimate_margin=1.0, lane_max_queued=4),
        tenants=TENANTS,
        max_batch_bytes=max_batch_bytes,
        batcher=batcher or TimerBatcher(),
        chooser=chooser or LeastLoaded(),
    )
    for _ in range(20):
        for rows in (1, 4):
            core.estimates.observe("m", "1", rows, 0.010 + 0.001 * rows)
    return core


def join(
    core: RouterCore,
    worker_id: str,
    now: float = 0.0,
    *,
    capacity: int = 2,
    ready: bool = True,
    device: str = "cuda",
) -> None:
    """A worker of m:1 registers (an accelerator unless `device` says otherwise), connects and reports
    READY."""
    core.worker_registered(now, worker_id, {("m", "1"): {}}, capacity, ready, device=device)
    core.worker_connected(now, worker_id, True)


def request(
    now: float,
    timeout: float = 1.0,
    *,
    tenant: str = "bronze",
    priority: int = 3,
    size: int = 100,
    rows: int = 1,
    lane: LaneKey = KEY,
    limits: LaneLimits = LIMITS,
) -> QueuedRequest:
    """A validated request arriving at `now`, under `limits`."""
    return QueuedRequest(
        next(_ids), lane, rows, now, now + timeout, limits=limits, tenant=tenant, priority=priority,
        size_bytes=size, latest_start=now + timeout,  # as `RouterCore.new_request` starts it
    )  # fmt: skip


def ok_answer(dispatch: Dispatch, execute_s: float = 0.005, queued: int | None = None) -> BatchAnswer:
    """Every item of the batch succeeded."""
    items = {r.request_id: ItemAnswer(outputs=[f"out-{r.request_id}"]) for r in dispatch.requests}
    return BatchAnswer(dispatch.batch_id, items, dispatch.rows, execute_s, queued)


def failed_answer(dispatch: Dispatch, *, worker_fault: bool, reason: str = "") -> BatchAnswer:
    """Every item failed INTERNAL (or UNAVAILABLE with a reason)."""
    code = int(Code.UNAVAILABLE if reason else Code.INTERNAL)
    items = {r.request_id: ItemAnswer(code, "failed", worker_fault, reason) for r in dispatch.requests}
    return BatchAnswer(dispatch.batch_id, items, 0 if reason else dispatch.rows, 0.005)


def outcomes(decision: Decision) -> dict[int, str]:
    """request id → OK or the error's `CODE/reason`."""
    return {s.request.request_id: _status(s.outcome) for s in decision.settled}


def _status(outcome: Served | SluiceError) -> str:
    return "OK" if isinstance(outcome, Served) else f"{outcome.code.name}/{outcome.reason}"


def occupy(core: RouterCore, worker_id: str = "w") -> Dispatch:
    """Join a worker that takes one batch at a time and give it one (never answered unless the test
    does): requests that arrive next stay queued."""
    join(core, worker_id, capacity=1)
    [dispatch] = core.arrive(0.0, request(0.0, timeout=60.0, tenant="gold", priority=1)).dispatches
    return dispatch
