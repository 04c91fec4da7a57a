"""The worker's heartbeat cadence (worker/report_cadence.py): every 0.25 s while it holds or was sent work,
its idle interval otherwise and only when every router reads the announcement, and a batch arriving
while it is slow brings the next report to within 0.25 s."""

from __future__ import annotations

import asyncio

import pytest

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.heartbeat import (
    BUSY_REPORT_INTERVAL_S,
    REPORT_INTERVAL_METADATA,
    reads_report_interval,
)
from sluice_inference.worker.report_cadence import ReportCadence

IDLE_S = 1.0


def cadence() -> tuple[FakeClock, ReportCadence]:
    clock = FakeClock(100.0)
    return clock, ReportCadence(clock, IDLE_S)


def test_an_idle_worker_reports_at_its_idle_interval_and_says_so() -> None:
    clock, reports = cadence()
    reports.plan_next(holding_work=False, every_stream_reads=True)
    assert reports.due == pytest.approx(100.0 + IDLE_S)
    assert reports.announced_ms() == 1000
    clock.advance(0.4)
    assert reports.announced_ms() == 600  # a report sent between says when the next one is due


@pytest.mark.parametrize(
    ("holding_work", "every_stream_reads"), [(True, True), (False, False)], ids=["busy", "older router"]
)
def test_the_pace_stays_busy_while_work_is_held_or_a_router_cannot_read_it(
    holding_work: bool, every_stream_reads: bool
) -> None:
    _, reports = cadence()
    reports.plan_next(holding_work=holding_work, every_stream_reads=every_stream_reads)
    assert reports.due == pytest.approx(100.0 + BUSY_REPORT_INTERVAL_S)
    assert reports.announced_ms() == 250


def test_work_sent_since_the_last_report_keeps_one_more_report_at_the_busy_pace() -> None:
    _, reports = cadence()
    reports.work_arrived()  # answered before the report: nothing held, but it worked
    reports.plan_next(holding_work=False, every_stream_reads=True)
    assert reports.due == pytest.approx(100.0 + BUSY_REPORT_INTERVAL_S)
    reports.plan_next(holding_work=False, every_stream_reads=True)
    assert reports.due == pytest.approx(100.0 + IDLE_S)


async def test_a_batch_arriving_while_slow_brings_the_next_report_forward() -> None:
    clock, reports = cadence()
    reports.plan_next(holding_work=False, every_stream_reads=True)
    waiting = asyncio.ensure_future(reports.wait())
    await asyncio.sleep(0)
    clock.advance(0.3)
    reports.work_arrived()
    assert reports.due == pytest.approx(100.3 + BUSY_REPORT_INTERVAL_S)
    await asyncio.sleep(0)
    assert not waiting.done()
    clock.advance(BUSY_REPORT_INTERVAL_S)
    await asyncio.wait_for(waiting, 1.0)
    reports.work_arrived()  # already at the busy pace: nothing moves
    assert reports.due == pytest.approx(100.3 + BUSY_REPORT_INTERVAL_S)


def test_an_older_router_opening_a_stream_while_slow_brings_the_next_report_forward() -> None:
    clock, reports = cadence()
    reports.plan_next(holding_work=False, every_stream_reads=True)
    clock.advance(0.1)
    reports.deaf_stream_opened()  # its bound is 0.8 s from the stream's first report
    assert reports.due == pytest.approx(100.1 + BUSY_REPORT_INTERVAL_S)
    reports.plan_next(holding_work=False, every_stream_reads=False)  # and stays busy while it is there
    assert reports.announced_ms() == 250


async def test_an_idle_worker_waits_its_whole_interval() -> None:
    clock, reports = cadence()
    reports.plan_next(holding_work=False, every_stream_reads=True)
    waiting = asyncio.ensure_future(reports.wait())
    clock.advance(IDLE_S - 0.01)
    await asyncio.sleep(0)
    assert not waiting.done()
    clock.advance(0.01)
    await asyncio.wait_for(waiting, 1.0)


def test_an_idle_interval_under_the_busy_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        ReportCadence(FakeClock(), 0.1)


def test_only_the_routers_metadata_says_it_reads_the_interval() -> None:
    assert reads_report_interval([("authorization", "x"), (REPORT_INTERVAL_METADATA, "1")])
    assert not reads_report_interval([("authorization", "x")])
    assert not reads_report_interval(None)
