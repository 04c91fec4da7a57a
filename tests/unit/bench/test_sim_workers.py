"""The simulated worker merges as the real one: the same waiting batches, fed to the real BatchRunner (its
device thread and executor, on a fake backend) and to a SimWorker, run as the same forwards.

The batches mix two padded shapes under a cost cap, so the merge's key, its first fit over every waiting
batch (not only the run next to the oldest) and the cost cap all show. The real runner's device is held
busy while they are submitted (tests/unit/worker/test_runner.py), so all of them wait when it frees up;
each forward's answers to one stream travel in one message, which says which batches ran together."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from sluice_inference.bench.sim.scenario import ModelSpec, Noise
from sluice_inference.bench.sim.workers import SimWorker
from sluice_inference.common.buckets import bucket_for, row_cost
from sluice_inference.common.clock import MonotonicClock
from sluice_inference.router.policy.lanes import LaneKey, QueuedRequest
from sluice_inference.router.policy.outcomes import Dispatch
from sluice_inference.worker.executor import Executor
from sluice_inference.worker.metrics import WorkerMetrics
from sluice_inference.worker.runner import BatchRunner, StreamState
from tests.support.hop import packed_batch
from tests.unit.worker.fakes import GatedBackend, RecordingBackend, fake_model, synthetic_config

BUCKETS = (4, 16)
MAX_ROWS, MAX_COST = 8, 32
HOLD = 999
WAITING = {  # batch id: (rows, length); bucket 4 costs 4 a row, bucket 16 costs 16
    1: (3, 3),
    2: (1, 10),
    3: (4, 2),
    4: (1, 12),
    5: (2, 4),
    6: (1, 1),
    7: (1, 16),
    8: (1, 4),
}
EXPECTED = [{1, 3, 6}, {2, 4}, {5, 8}, {7}]
"""By hand: 1 takes 3 and 6 (8 rows, cost 32) past 2 and 5; 2 takes 4 (cost 32), not 7; 5 takes 8."""


async def real_forwards() -> list[set[int]]:
    variable = [{"name": "x", "datatype": "FP32", "dims": [-1]}]
    seq = synthetic_config(
        "seq",
        backend="torch_export",
        synthetic=None,
        inputs=variable,
        outputs=[{**variable[0], "name": "y"}],
        max_batch_size=MAX_ROWS,
        batching={"buckets": {"x": list(BUCKETS)}, "max_batch_cost": MAX_COST},
    )
    gated = GatedBackend(RecordingBackend())
    models = {
        ("hold", "1"): fake_model(synthetic_config("hold"), gated),
        ("seq", "1"): fake_model(seq, RecordingBackend()),
    }
    runner = BatchRunner(Executor(), models, WorkerMetrics(), capacity=16, clock=MonotonicClock())
    stream = StreamState()
    hold = packed_batch(HOLD, "hold", "1", [(HOLD, {"x": np.zeros((1, 4), "<f4")})], budget_us=10**7)
    batches = [
        packed_batch(i, "seq", "1", [(i, {"x": np.zeros((rows, n), "<f4")})], budget_us=10**7)
        for i, (rows, n) in WAITING.items()
    ]
    runner.start()
    try:
        runner.submit([hold], stream)
        assert await asyncio.to_thread(gated.started.wait, 5)
        runner.submit(batches, stream)
        gated.gate.set()
        forwards: list[set[int]] = []
        while sum(map(len, forwards)) < 1 + len(WAITING):
            message = await asyncio.wait_for(stream.outbox.get(), 5)
            assert message is not None
            assert all(not result.errors for result in message.results)
            forwards.append({result.batch_id for result in message.results})
    finally:
        await runner.stop()
    assert forwards[0] == {HOLD}
    return forwards[1:]


def dispatch(batch_id: int, rows: int, length: int) -> Dispatch:
    """A batch as a router cuts it: its lane keyed by the padded shape, its cost as the codec counts it."""
    padded = (bucket_for(length, BUCKETS),)
    lane = LaneKey("seq", "1", (("x", padded),))
    cost = rows * row_cost([((-1,), padded)])
    request = QueuedRequest(batch_id, lane, rows, 0.0, 10.0, payload=(batch_id, 0), cost=cost)
    return Dispatch(batch_id, "w", lane, (request,), "test", 0.0, 0.0, rows)


def sim_forwards() -> list[set[int]]:
    model = ModelSpec(name="seq", max_batch_size=MAX_ROWS, max_batch_cost=MAX_COST)
    worker = SimWorker("w", 1.0, model, Noise(), [1.0], random.Random(0), capacity=16)
    running, _ = worker.accept(dispatch(HOLD, 1, 4), 0, 0.0)
    assert running is not None  # the device was idle: the hold runs, everything else waits
    for batch_id, (rows, length) in WAITING.items():
        assert worker.accept(dispatch(batch_id, rows, length), 0, 0.0) == (None, None)
    forwards: list[set[int]] = []
    while True:
        _, running = worker.finish(running.ends)
        if running is None:
            return forwards
        forwards.append({held.dispatch.batch_id for held in running.batches})


async def test_the_simulated_worker_runs_the_same_forwards_as_the_runner() -> None:
    assert await real_forwards() == EXPECTED
    assert sim_forwards() == EXPECTED
