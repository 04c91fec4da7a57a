"""One core, two drivers: the asyncio driver and the simulator, fed the same scripted events, make the
router core take identical decisions — so the simulator cannot drift from the server (issue 10).

Each side builds its requests from the same arrivals and its answers from the same script; a recording
core (a subclass that logs every event's decision) sits under both. The script exercises batching, an
answer, a late answer, a lost worker with re-dispatch, an overdue request and an arrival with no time left.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from sluice_inference.bench.sim.engine import Simulation, make_core
from sluice_inference.bench.sim.plan import RunPlan, plan_run
from sluice_inference.bench.sim.scenario import parse_sim_scenario
from sluice_inference.common.clock import FakeClock
from sluice_inference.common.errors import SluiceError
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.records import ModelRecord, TensorSpec
from sluice_inference.common.serving_settings import TenantSettings
from sluice_inference.router.calls import Tensor
from sluice_inference.router.codec import DecodedRequest
from sluice_inference.router.driver import Driver
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.core import RouterCore
from sluice_inference.router.policy.outcomes import BatchAnswer, Decision, ItemAnswer, Served
from sluice_inference.router.policy.tenants import Tenant
from sluice_inference.router.worker_link import WorkerLinks
from tests.unit.router.driver_support import FakeLink

SCENARIO = {
    "duration_s": 1.0,
    "rate": 10,
    "seed": 5,
    "model": {"name": "synthetic", "base_ms": 5, "per_item_ms": 1, "max_batch_size": 4, "max_wait_ms": 2},
    "classes": [
        {"name": "gold", "tenant": "gold", "priority": 1, "deadline_ms": 100, "length": 16},
        {"name": "bronze", "tenant": "bronze", "priority": 3, "deadline_ms": 40, "length": 16},
    ],
    "workers": [{"name": "w", "count": 2, "capacity": 2}],
}
# (time, event, argument): arrivals name their class; answers name the batch (dispatch order, from 1).
SCRIPT: list[tuple[float, str, Any]] = [
    (0.000, "arrive", 0),
    (0.000, "arrive", 0),
    (0.001, "arrive", 1),
    (0.002, "arrive", 0),
    (0.003, "tick", None),
    (0.009, "answer", 1),
    (0.010, "arrive", 1),
    (0.012, "tick", None),
    (0.015, "lose", "w0"),
    (0.020, "answer", 4),
    (0.030, "arrive", 0),
    (0.045, "tick", None),
    (0.060, "answer", 2),
    (0.200, "tick", None),
    (0.300, "arrive", 1),
    (0.500, "tick", None),
]


class DecisionLog:
    """Every decision a core returns (normalised), through its observer: the core is compiled, so the
    test cannot subclass it."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, tuple[Any, ...]]] = []

    def __call__(self, event: str, decision: Decision) -> None:
        self.entries.append((event, normalised(decision)))


def normalised(decision: Decision) -> tuple[Any, ...]:
    def status(outcome: Served | SluiceError) -> str:
        return "OK" if isinstance(outcome, Served) else f"{outcome.code.name}/{outcome.reason}"

    return (
        [
            (d.batch_id, d.worker_id, [r.request_id for r in d.requests], d.reason)
            for d in decision.dispatches
        ],
        sorted((s.request.request_id, status(s.outcome)) for s in decision.settled),
        sorted(decision.drops.items()),
        decision.lost,
        None if decision.wake_at is None else round(decision.wake_at, 9),
    )


def recording_core(router: int, plan: RunPlan) -> RouterCore:
    return make_core(router, plan, observer=DecisionLog())


def log_of(core: RouterCore) -> DecisionLog:
    assert isinstance(core.observer, DecisionLog)
    return core.observer


def answer_for(core: RouterCore, batch_id: int, execute_s: float) -> tuple[str, BatchAnswer]:
    dispatch = core.in_flight[batch_id]
    items = {r.request_id: ItemAnswer(outputs=[]) for r in dispatch.requests}
    return dispatch.worker_id, BatchAnswer(batch_id, items, dispatch.rows, execute_s, queued_batches=0)


def simulate_script(plan: RunPlan) -> list[tuple[str, tuple[Any, ...]]]:
    sim = Simulation(plan, core_factory=recording_core)
    [core] = sim.cores
    log_of(core).entries.clear()
    arrivals = 0
    for now, event, argument in SCRIPT:
        if event == "arrive":
            sim.arrive(arrivals, argument, now)
            arrivals += 1
        elif event == "tick":
            sim.tick(0, now)
        elif event == "answer":
            worker_id, answer = answer_for(core, argument, 0.004)
            sim.answered(0, worker_id, answer, now)
        else:
            sim.worker_left(argument, "lost", now)
    return log_of(core).entries


async def drive_script(plan: RunPlan) -> list[tuple[str, tuple[Any, ...]]]:
    clock = FakeClock(0.0)
    core = recording_core(0, plan)
    links = WorkerLinks()
    driver = Driver(clock, core, links, RouterMetrics())
    model = plan.scenario.model
    warmup = {rows: model.batch_seconds(rows, 1.0) for rows in (1, model.max_batch_size)}
    for worker_id in ("w0", "w1"):
        links.add(FakeLink(worker_id))
        driver.worker_registered(worker_id, {(model.name, model.version): warmup}, 2, True, "cuda")
        driver.worker_connected(worker_id, True)
    log_of(core).entries.clear()
    calls = []
    for now, event, argument in SCRIPT:
        clock.jump_to(now)
        if event == "arrive":
            spec = plan.scenario.classes[argument]
            deadline = now + spec.deadline_ms / 1000.0
            tenant = Tenant(spec.tenant, TenantSettings(rate=1e12, burst=10**12, max_inflight=10**12,
                                                        default_priority=9, max_priority=1))  # fmt: skip
            decoded = decoded_request(plan, argument)
            pending = driver.infer(decoded, deadline, tenant, spec.priority, arrival=now)
            calls.append(asyncio.ensure_future(pending))
            await asyncio.sleep(0)
        elif event == "tick":
            driver.tick()
        elif event == "answer":
            worker_id, answer = answer_for(core, argument, 0.004)
            result = worker_pb2.BatchResult(batch_id=argument, executed_size=answer.executed_rows,
                                            forward_rows=answer.executed_rows, queued_batches=0,
                                            execute_us=round(answer.execute_s * 1e6))  # fmt: skip
            result.item_ids.extend(answer.items)
            result.item_rows.extend([1] * len(answer.items))
            driver.on_message(worker_id, worker_pb2.WorkerMessage(results=[result]))
        else:
            driver.worker_left(argument, "lost")
    log = list(log_of(core).entries)
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    return log


def decoded_request(plan: RunPlan, cls: int) -> DecodedRequest:
    """What the servicer would decode for one of the scenario's requests (the simulator's request shape:
    rows x length FP32 inputs, no response bytes counted)."""
    spec = plan.scenario.classes[cls]
    model = plan.scenario.model
    data = np.zeros((spec.rows, spec.length), "<f4").tobytes()
    tensor = Tensor("x", "FP32", (spec.rows, spec.length), data)
    x = TensorSpec(name="x", datatype="FP32", dims=(spec.length,))
    record = ModelRecord(name=model.name, version=model.version, digest="d", platform="synthetic",
                         max_batch_size=model.max_batch_size, max_wait_s=model.max_wait_ms / 1000.0,
                         inputs=(x,), outputs=(x,))  # fmt: skip
    return DecodedRequest(record=record, client_id="", inputs=(tensor,), outputs=(), rows=spec.rows,
                          lane=plan.lanes[cls], timeout_s=None, cost=spec.rows * spec.length,
                          input_bytes=len(data))  # fmt: skip


async def test_the_driver_and_the_simulator_make_the_core_take_identical_decisions() -> None:
    plan = plan_run(parse_sim_scenario(SCENARIO))
    simulated = simulate_script(plan)
    driven = await drive_script(plan)
    assert driven == simulated
    # and the script is not trivial: it dispatched, answered, re-dispatched, and ended requests both ways
    statuses = {status for _, (_, settled, *_) in simulated for _, status in settled}
    assert "OK" in statuses and statuses - {"OK"}, statuses
    assert sum(len(dispatches) for _, (dispatches, *_) in simulated) >= 4
