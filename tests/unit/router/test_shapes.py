"""Per-shape state is bounded (router/policy/shapes.py): a client minting input shapes cannot grow the
router's lanes, statistics or estimates, nor the status pass that reads them; bucketed traffic batches as
it always did."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from grpc_health.v1._async import HealthServicer

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.errors import SluiceError
from sluice_inference.common.records import ModelRecord, TensorSpec, WorkerRecord
from sluice_inference.common.serving_settings import (
    AdmissionSettings,
    AutoscaleSettings,
    CacheSettings,
    RouterSettings,
    TenantSettings,
)
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.cache_gate import CacheGate
from sluice_inference.router.calls import InferCall, InputTensor
from sluice_inference.router.codec import decode_call
from sluice_inference.router.cpu_pressure import CpuPressure
from sluice_inference.router.driver import Driver
from sluice_inference.router.live_stats import LiveStats
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.peers import PeerView
from sluice_inference.router.policy.batcher import TimerBatcher
from sluice_inference.router.policy.budget import ByteBudget
from sluice_inference.router.policy.catalog import ModelCatalog
from sluice_inference.router.policy.core import RouterCore
from sluice_inference.router.policy.lane_stats import LaneStats
from sluice_inference.router.policy.lanes import Lane, LaneKey, LaneLimits
from sluice_inference.router.policy.outcomes import Decision, Dispatch
from sluice_inference.router.policy.shapes import MAX_SHAPES_PER_MODEL, ShapeTable
from sluice_inference.router.status import StatusLoop
from sluice_inference.router.stores.cache_store import ResultCacheStore
from sluice_inference.router.worker_link import WorkerLinks
from tests.unit.router.core_support import ok_answer, outcomes

TENANT = "anonymous"
TENANTS = {TENANT: TenantSettings(rate=1e9, burst=10**9, max_inflight=10**6)}
FLOOD = ModelRecord(
    name="flood",
    version="1",
    digest="sha256:flood",
    platform="synthetic",
    max_batch_size=8,
    max_wait_s=0.0,
    inputs=(TensorSpec(name="x", datatype="FP32", dims=(3, -1, -1)),),  # two variable dims, no buckets
    outputs=(TensorSpec(name="y", datatype="FP32", dims=(3,)),),
)
ENCODER = ModelRecord(  # the demo `encoder`'s batching: sequence buckets
    name="encoder",
    version="1",
    digest="sha256:encoder",
    platform="torch_export",
    max_batch_size=32,
    max_wait_s=0.002,
    inputs=(TensorSpec(name="tokens", datatype="INT64", dims=(-1,)),),
    outputs=(TensorSpec(name="embedding", datatype="FP32", dims=(64,)),),
    buckets={"tokens": (16, 32, 64, 128)},
)


def make_core(shapes: ShapeTable | None = None) -> RouterCore:
    return RouterCore(
        0.0,
        settings=RouterSettings(),
        admission=AdmissionSettings(),
        tenants=TENANTS,
        batcher=TimerBatcher(),
        shapes=shapes,
    )


def join(core: RouterCore, record: ModelRecord, worker_id: str = "w", capacity: int = 4) -> None:
    core.worker_registered(
        0.0, worker_id, {(record.name, record.version): {1: 0.001}}, capacity, True, device="cuda"
    )
    core.worker_connected(0.0, worker_id, True)


def call(record: ModelRecord, shape: tuple[int, ...], data: bytes = b"") -> InferCall:
    """A call of `record` with one input of `shape` (empty payload: `[1, 3, 0, k]` holds no element)."""
    spec = record.inputs[0]
    tensor = InputTensor(spec.name, spec.datatype, shape, data=data)
    return InferCall(record.name, "", "flood", (tensor,), (), {}, None, None, None, body_bytes=64)


def arrive(core: RouterCore, record: ModelRecord, shape: tuple[int, ...], now: float) -> Decision:
    """Decode a call as the data plane does and hand it to the core."""
    data = bytes(8 * shape[1]) if record is ENCODER else b""
    decoded = decode_call(call(record, shape, data), record)
    request = core.new_request(
        now, lane=decoded.lane, rows=decoded.rows, deadline=now + 1.0, payload=None, tenant=TENANT,
        priority=1, limits=LaneLimits.of(record), cost=decoded.cost,
    )  # fmt: skip
    return core.arrive(now, request)


def answer_all(core: RouterCore, decision: Decision, now: float) -> dict[int, str]:
    """Answer every batch the decision sent (and those its answers sent), at once: the request outcomes."""
    ended = outcomes(decision)
    pending = list(decision.dispatches)
    while pending:
        dispatch = pending.pop()
        answered = core.answered(now, dispatch.worker_id, ok_answer(dispatch))
        ended |= outcomes(answered)
        pending.extend(answered.dispatches)
    return ended


def status_loop(driver: Driver, catalog: ModelCatalog, clock: FakeClock) -> StatusLoop:
    """The router's status pass over `driver`, with no etcd behind it."""
    metrics = RouterMetrics()
    store = ResultCacheStore(capacity_bytes=1024, ttl_s=1.0, clock=clock)
    return StatusLoop(
        driver=driver,
        catalog=catalog,
        peers=PeerView(
            EtcdSettings(), TENANTS, require_api_key=False, driver=driver, metrics=metrics, clock=clock
        ),
        watches=(),
        cache=CacheGate(store, CacheSettings(), metrics),
        live=LiveStats(),
        metrics=metrics,
        inflight_bytes=ByteBudget(1024 * 1024),
        health=HealthServicer(),
        autoscale=AutoscaleSettings(),
        etcd_connected=lambda: True,
        clock=clock,
        pressure=CpuPressure(clock.now, lambda: (0.0, 0.0)),
    )


def count_calls(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    """Count calls of `cls.name` (one per entry the status pass reads)."""
    calls = [0]
    method: Callable[..., Any] = getattr(cls, name)

    def counted(self: object, *args: object) -> Any:
        calls[0] += 1
        return method(self, *args)

    monkeypatch.setattr(cls, name, counted)
    return calls


async def test_a_shape_flood_leaves_per_shape_state_and_the_status_pass_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """5,000 empty requests `[1, 3, 0, k]`, each k new: every one is served, and the router keeps state
    for at most `MAX_SHAPES_PER_MODEL` of their shapes; the status pass reads one entry per model and per
    lane holding requests, not one per shape ever sent (it read 5,000 lane statistics every 200 ms)."""
    clock = FakeClock(0.0)
    core = make_core()
    join(core, FLOOD)
    ended: dict[int, str] = {}
    for k in range(1, 5001):
        clock.advance(0.001)
        ended |= answer_all(core, arrive(core, FLOOD, (1, 3, 0, k), clock.now()), clock.now() + 0.0005)
    assert len(ended) == 5000 and set(ended.values()) == {"OK"}

    assert len(core.queues.stats) <= MAX_SHAPES_PER_MODEL
    state = core.view.shape_state()
    assert state["shapes"] == MAX_SHAPES_PER_MODEL
    for table in ("lanes", "lane_stats", "lane_limits", "waiting", "lanes_in_flight"):
        assert state[table] <= MAX_SHAPES_PER_MODEL, (table, state)
    # fits: the version's, and per shape across workers and on the one worker
    assert state["fits"] <= 1 + 2 * MAX_SHAPES_PER_MODEL, state

    catalog = ModelCatalog()
    worker = WorkerRecord(
        worker_id="w", addr="x:1", device="cpu", models=(FLOOD,), capacity=4, state="ready", started_at=0.0
    )
    catalog.update({"w": worker})
    driver = Driver(clock, core, WorkerLinks(), RouterMetrics())
    status = status_loop(driver, catalog, clock)
    rates = count_calls(monkeypatch, LaneStats, "rate")
    lanes = count_calls(monkeypatch, Lane, "oldest_arrival")
    driver.start()
    try:
        await status.refresh()
    finally:
        await driver.stop()
    assert not status.core_stuck
    assert rates[0] <= len(catalog.names())
    assert lanes[0] <= len(core.queues.lanes) <= MAX_SHAPES_PER_MODEL
    assert status.desired_workers("flood") >= 1  # the pass still saw the model's traffic


def test_a_busy_shape_is_never_forgotten_and_a_new_shape_is_refused_while_every_one_is_busy() -> None:
    """Queued or running work keeps its shape; a newcomer then gets a retryable refusal, and is admitted
    once a shape is idle again (it takes the least recently used idle shape's place)."""
    core = make_core(ShapeTable(limit=2))
    join(core, FLOOD, capacity=1)
    running = arrive(core, FLOOD, (1, 3, 0, 1), 0.0).dispatches  # shape 1 on the worker
    queued = arrive(core, FLOOD, (1, 3, 0, 2), 0.001)  # shape 2 queued: the worker is full
    assert len(running) == 1 and not queued.dispatches and not queued.settled

    refused = arrive(core, FLOOD, (1, 3, 0, 3), 0.002)
    [settled] = refused.settled
    assert isinstance(settled.outcome, SluiceError)
    assert (settled.outcome.reason, settled.outcome.retryable) == ("too_many_shapes", True)
    assert settled.outcome.retry_after_s is not None and settled.outcome.retry_after_s > 0
    assert core.view.shape_state()["shapes"] == 2
    assert core.admission.limiter.inflight[TENANT] == 2  # the refused one gave its slot back

    pending = Decision()
    pending.dispatches.extend(running)
    ended = answer_all(core, pending, 0.003)  # shape 1, then shape 2, run
    assert set(ended.values()) == {"OK"} and len(ended) == 2
    admitted = arrive(core, FLOOD, (1, 3, 0, 3), 0.004)
    assert [d.lane for d in admitted.dispatches] == [_lane(FLOOD, (3, 0, 3))]
    assert _lane(FLOOD, (3, 0, 1)) not in core.shapes  # the least recently used idle shape went
    assert _lane(FLOOD, (3, 0, 2)) in core.shapes


def test_the_least_recently_used_idle_shape_goes_first() -> None:
    table = ShapeTable(limit=2)
    a, b, c = (_lane(FLOOD, (3, 0, k)) for k in (1, 2, 3))
    idle: Callable[[LaneKey], bool] = lambda _key: False  # noqa: E731
    assert table.use(a, idle) == [] and table.use(b, idle) == [] and table.use(a, idle) == []
    assert table.use(c, idle) == [b]
    assert table.use(b, lambda key: key == a) == [c]  # a is busy: c, though used later, goes
    assert table.use(c, lambda _key: True) is None  # all busy: refused, nothing forgotten
    assert len(table) == 2 and a in table and b in table


def test_bucketed_variable_length_traffic_still_shares_lanes_and_batches() -> None:
    """The demo encoder's lengths 1..128 fall into its four buckets: four shapes, and requests of
    different lengths in one bucket leave in one batch."""
    core = make_core()
    join(core, ENCODER, capacity=1)
    blocker = arrive(core, ENCODER, (1, 128), 0.0).dispatches  # the worker is busy: the rest queue
    for length in range(1, 129):
        decision = arrive(core, ENCODER, (1, length), 0.0001 * length)
        assert not decision.settled and not decision.dispatches
    assert core.view.shape_state()["shapes"] == 4
    assert sorted(len(lane) for lane in core.queues.lanes.values()) == [16, 16, 32, 64]

    sent: list[Dispatch] = []
    pending = list(blocker)
    while pending:
        answered = core.answered(0.02, pending[0].worker_id, ok_answer(pending.pop()))
        sent += answered.dispatches
        pending += answered.dispatches
    assert len(sent) == 5  # 16, 16, 32, 32 + 32 rows: full batches of mixed lengths
    assert all(len({r.request_id for r in d.requests}) == d.rows for d in sent)
    assert sorted(d.rows for d in sent) == [16, 16, 32, 32, 32]


def _lane(record: ModelRecord, dims: tuple[int, ...]) -> LaneKey:
    return LaneKey(record.name, record.version, ((record.inputs[0].name, dims),))
