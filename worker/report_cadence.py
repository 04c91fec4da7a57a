"""When the worker's next load report goes out: its heartbeat to the routers.

A router closes a stream it has not heard from in time (router/worker_link.py `SilenceWatch`) and sends
its batches elsewhere, so while a worker holds batches it reports every `BUSY_REPORT_INTERVAL_S`, however
long its forwards run. With nothing to do, four reports a second only tell routers what they know, and
each costs both processes a wake-up and ~0.7 ms of Python (docs/performance.md, "Idle"): an idle worker
reports every `worker.idle_report_interval_s` instead, and each report announces how long until the next
one at the latest (`LoadReport.report_interval_ms`), from which the router sets its silence bound.

Only routers that said they read the announcement (common/heartbeat.py `REPORT_INTERVAL_METADATA`) may
be sent the slow cadence: an older router keeps its fixed 0.8 s bound and would close an idle worker's
stream.
The cadence is the worker's, one for every stream, so a single older router keeps it fast, from the
moment its stream opens.
A batch arriving while the cadence is slow brings the next report forward to within the busy interval:
the router measures its bound from the batch it sent, not from the last report.
"""

from __future__ import annotations

import asyncio
import functools

from sluice_inference.common.clock import Clock
from sluice_inference.common.heartbeat import BUSY_REPORT_INTERVAL_S


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


class ReportCadence:
    """When the next load report is due, on the injected clock."""

    def __init__(self, clock: Clock, idle_interval_s: float) -> None:
        if idle_interval_s < BUSY_REPORT_INTERVAL_S:
            raise ValueError(f"idle_interval_s must be at least {BUSY_REPORT_INTERVAL_S} s")
        self._clock = clock
        self._idle_interval_s = idle_interval_s
        self._due = clock.now() + BUSY_REPORT_INTERVAL_S
        self._slow = False
        """The pending interval is the idle one: a batch arriving must bring the report forward."""
        self._worked = False
        """A batch arrived since the last report."""
        self._woken: asyncio.Future[None] | None = None

    @property
    def due(self) -> float:
        """Clock time of the next report at the latest."""
        return self._due

    def announced_ms(self) -> int:
        """What a report sent now says of the next one: milliseconds until it is due, at the latest."""
        return max(0, round((self._due - self._clock.now()) * 1000.0))

    def work_arrived(self) -> None:
        """Batches came on a stream (once per stream message: one flag test while the cadence is fast)."""
        self._worked = True
        if self._slow:
            self._hurry()

    def deaf_stream_opened(self) -> None:
        """A router that does not read the announcement opened a stream: it expects the busy pace from
        its first message on, so the pending report is brought forward now, not one idle interval later."""
        if self._slow:
            self._hurry()

    def _hurry(self) -> None:
        self._slow = False
        self._due = min(self._due, self._clock.now() + BUSY_REPORT_INTERVAL_S)
        if self._woken is not None:
            _wake(self._woken)

    def plan_next(self, *, holding_work: bool, every_stream_reads: bool) -> None:
        """A report goes out now: set when the next one is due. Slow only when the worker holds no batch,
        was sent none since the last report, and every open stream's router reads the announcement."""
        idle = not holding_work and not self._worked and every_stream_reads
        self._worked = False
        self._slow = idle and self._idle_interval_s > BUSY_REPORT_INTERVAL_S
        self._due = self._clock.now() + (self._idle_interval_s if self._slow else BUSY_REPORT_INTERVAL_S)

    async def wait(self) -> None:
        """Return once the next report is due (sooner when a batch brings it forward)."""
        loop = asyncio.get_running_loop()
        while self._clock.now() < self._due:
            woken: asyncio.Future[None] = loop.create_future()
            self._woken = woken
            timer = self._clock.call_at(self._due, functools.partial(_wake, woken))
            try:
                await woken
            finally:
                timer.cancel()
                self._woken = None
