"""The asyncio driver with fake worker links: a bug fails only the requests it concerns, deadlines hold after
dispatch, a hung worker is treated as lost, batches cut together travel together, the loop sleeps until the
core's next wake-up (the status pass beside it: test_status.py), and a refusal leaves no reference cycle
behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from sluice_inference.common.clock import FakeClock, MonotonicClock
from sluice_inference.common.errors import Code
from sluice_inference.router.policy.batcher import BatchContext, Cut, WakeAt
from sluice_inference.router.policy.lanes import Lane
from sluice_inference.router.worker_link import WorkerLinks
from tests.support.garbage import cyclic_garbage
from tests.support.processes import eventually
from tests.unit.router.driver_support import RECORD, TENANT, FakeLink, decoded, infer, join, make_driver


@pytest.fixture
async def links() -> AsyncIterator[WorkerLinks]:
    yield WorkerLinks()


async def test_a_batch_that_cannot_be_sent_fails_alone_and_the_loop_goes_on(links: WorkerLinks) -> None:
    driver = make_driver(links)
    links.add(FakeLink("w1", driver, fail_sends=1))
    join(driver, "w1")
    driver.start()
    try:
        assert await infer(driver) == Code.INTERNAL
        assert [await infer(driver) for _ in range(3)] == [Code.OK] * 3
        assert driver.healthy(driver.clock.now())
    finally:
        await driver.stop()


async def test_a_batch_the_worker_refuses_as_busy_runs_on_another_worker(links: WorkerLinks) -> None:
    driver = make_driver(links)
    full, free = FakeLink("w1", driver, busy=1), FakeLink("w2", driver)
    links.add(full)
    links.add(free)
    join(driver, "w1")
    driver.start()
    try:
        pending = asyncio.ensure_future(infer(driver))
        await eventually(lambda: bool(full.sent), 2.0, "a batch sent to w1")
        join(driver, "w2")
        assert await pending == Code.OK  # not the worker's UNAVAILABLE: the router placed it again
        assert any(m.batches for m in free.sent)
        assert driver.core.workers.get("w1").others == 4  # type: ignore[union-attr]  # its queue is known
    finally:
        await driver.stop()


async def test_a_dispatched_request_ends_at_its_deadline_and_the_worker_is_told_to_drop_it(
    links: WorkerLinks,
) -> None:
    driver = make_driver(links)
    silent = FakeLink("w1")  # takes the batch, never answers
    links.add(silent)
    join(driver, "w1")
    driver.start()
    try:
        started = driver.clock.now()
        assert await infer(driver, timeout_s=0.3) == Code.DEADLINE_EXCEEDED
        assert driver.clock.now() - started < 0.3 + 0.25  # stated tolerance: one loop pass on a busy box
        sent = [b.item_ids[0] for m in silent.sent for b in m.batches]
        assert silent.cancelled_items() == sent
    finally:
        await driver.stop()


async def test_a_worker_that_hangs_is_treated_as_lost_and_its_request_runs_elsewhere(
    links: WorkerLinks,
) -> None:
    driver = make_driver(links, worker_hang_s=0.2)
    hung, healthy = FakeLink("w1"), FakeLink("w2")
    links.add(hung)
    links.add(healthy)
    join(driver, "w1")
    driver.start()
    try:
        pending = asyncio.ensure_future(infer(driver, timeout_s=5.0))
        await eventually(lambda: bool(hung.sent), 2.0, "a batch sent to w1")
        healthy.driver = driver
        join(driver, "w2")
        assert await pending == Code.OK
        assert hung.closed_by_router
        assert "w1" not in driver.core.workers
    finally:
        await driver.stop()


async def test_batches_cut_in_one_decision_for_one_worker_travel_in_one_message(links: WorkerLinks) -> None:
    clock = MonotonicClock()
    driver = make_driver(links, batcher=_HoldingBatcher(clock.now() + 0.2))
    link = FakeLink("w1", driver)
    links.add(link)
    join(driver, "w1")
    one_row = RECORD.model_copy(update={"max_batch_size": 1})  # two requests: two batches, cut together
    driver.start()
    try:
        now = driver.clock.now()
        replies = await asyncio.gather(
            *(driver.infer(decoded(one_row, v), now + 5, TENANT, 1, arrival=now) for v in (1.0, 2.0))
        )
    finally:
        await driver.stop()
    [message] = link.sent
    assert len(message.batches) == 2 and [b.item_rows for b in message.batches] == [[1], [1]]
    sent = [np.frombuffer(b.inputs[0].data, "<f4") for b in message.batches]
    assert sorted(float(x[0]) for x in sent) == [1.0, 2.0]  # each batch its own request's bytes
    assert [len(r.outputs) for r in replies] == [1, 1]


async def test_a_fake_clock_drives_the_loops_sleep(links: WorkerLinks) -> None:
    clock = FakeClock(100.0)
    batcher = _HoldingBatcher(100.3)
    driver = make_driver(links, batcher=batcher, clock=clock)
    link = FakeLink("w1", driver)
    links.add(link)
    join(driver, "w1")
    driver.start()
    try:
        reply = asyncio.ensure_future(driver.infer(decoded(), 105.0, TENANT, 1, arrival=100.0))
        await asyncio.sleep(0.05)  # real time passes; the fake clock does not, so nothing is cut
        assert not link.sent and not reply.done()
        clock.jump_to(100.3)  # the loop's alarm is a timer on the injected clock: it wakes now
        assert len((await asyncio.wait_for(reply, 1.0)).outputs) == 1
        assert [len(m.batches) for m in link.sent] == [1]
    finally:
        await driver.stop()


async def test_the_loop_sleeps_until_the_time_the_core_asked_for(links: WorkerLinks) -> None:
    clock = MonotonicClock()
    batcher = _HoldingBatcher(clock.now() + 0.3)
    driver = make_driver(links, batcher=batcher)
    links.add(FakeLink("w1", driver))
    join(driver, "w1")
    driver.start()
    try:
        assert await infer(driver) == Code.OK
        assert clock.now() >= batcher.at
        # Asked on arrival, when woken, and at most a few heartbeats more; a loop that spun until the
        # wake time asked thousands of times.
        assert batcher.asked <= 5, batcher.asked
    finally:
        await driver.stop()


class _HoldingBatcher:
    """Holds every batch until `at`, counting how often it is asked."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.asked = 0

    def decide(self, lane: Lane, ctx: BatchContext) -> Cut | WakeAt:
        self.asked += 1
        return Cut("held") if ctx.now >= self.at else WakeAt(self.at, lane.limits.max_batch_size)


async def test_a_refused_request_leaves_no_reference_cycle(links: WorkerLinks) -> None:
    """The refusal raised out of `infer` has that frame in its traceback, and the frame held the future
    (and the request, whose waiter holds it) that holds the error: ~50 objects per refusal that only the
    cyclic collector freed, until the frame let go of both."""
    driver = make_driver(links)  # no worker: every request ends UNAVAILABLE at once
    with cyclic_garbage() as garbage:
        codes = [await infer(driver) for _ in range(20)]
    assert codes == [Code.UNAVAILABLE] * 20
    assert garbage.found == 0
