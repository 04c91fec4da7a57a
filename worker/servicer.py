"""The worker's gRPC servicers: the router stream (`sluice.v1.Worker`) and `sluice.v1.WorkerAdmin`.

A stream opens with a LoadReport; then batches and cancellations flow in, results and load reports flow
out. Every stream gets a LoadReport whenever the worker's state changes (e.g. DRAINING), so routers stop
sending on the same connection the batches travel on, without waiting for etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeAlias

import grpc

from sluice_inference.common.clock import Clock, wait_until
from sluice_inference.common.heartbeat import reads_report_interval
from sluice_inference.common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc
from sluice_inference.worker.auth import stream_caller
from sluice_inference.worker.report_cadence import ReportCadence
from sluice_inference.worker.runner import BatchRunner, StreamState

log = logging.getLogger(__name__)
Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class WorkerState:
    """The worker's lifecycle state, and the streams to tell when it changes."""

    def __init__(self, worker_id: str, runner: BatchRunner, cadence: ReportCadence) -> None:
        self.worker_id = worker_id
        self.state: worker_pb2.WorkerState.ValueType = worker_pb2.WORKER_STATE_STARTING
        self.runner = runner
        self.cadence = cadence
        """When the next load report is due (the heartbeat; worker/heartbeat.py)."""
        self.streams: set[StreamState] = set()

    def load_report(self) -> worker_pb2.LoadReport:
        """The current load, as sent to routers, with when the next report is due."""
        return worker_pb2.LoadReport(
            worker_id=self.worker_id,
            state=self.state,
            queued_batches=self.runner.pending_batches,
            queued_items=self.runner.queued_items,
            busy_fraction=self.runner.busy_fraction(),
            report_interval_ms=self.cadence.announced_ms(),
        )

    def every_stream_reads_interval(self) -> bool:
        """Whether every open stream's router reads `report_interval_ms` (so reports may slow down)."""
        return all(stream.reads_interval for stream in self.streams)

    def broadcast(self) -> None:
        """Send the current load report on every open stream."""
        message = worker_pb2.WorkerMessage(load=self.load_report())
        for stream in list(self.streams):
            stream.send(message)

    def set(self, state: worker_pb2.WorkerState.ValueType) -> None:
        """Change state and tell every router."""
        self.state = state
        self.broadcast()


class WorkerStreamServicer(worker_pb2_grpc.WorkerServicer):
    """`sluice.v1.Worker/Stream`: one per router."""

    def __init__(self, state: WorkerState) -> None:
        self._state = state

    async def Stream(
        self, request_iterator: AsyncIterator[worker_pb2.RouterMessage], context: Context
    ) -> AsyncIterator[worker_pb2.WorkerMessage]:
        """Read batches into the runner; write results and load reports back. The gate has proved the
        caller is a router of the cluster (worker/auth.py) before this runs."""
        log.info("stream opened by %s", stream_caller(context))
        stream = StreamState(reads_interval=reads_report_interval(context.invocation_metadata()))
        if not stream.reads_interval:
            self._state.cadence.deaf_stream_opened()
        self._state.streams.add(stream)
        reader = asyncio.create_task(self._read(request_iterator, stream))
        try:
            yield worker_pb2.WorkerMessage(load=self._state.load_report())
            while (message := await stream.outbox.get()) is not None:
                yield message
        finally:
            stream.open = False
            self._state.streams.discard(stream)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[worker_pb2.RouterMessage], stream: StreamState) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for message in requests:
                if message.HasField("cancel"):  # first: it names items sent before this message
                    stream.cancel(message.cancel.item_ids)
                if message.batches:
                    self._state.runner.submit(message.batches, stream)
                    self._state.cadence.work_arrived()
        # The router closed its side: let pending results go out, then end the stream.
        await self._state.runner.wait_idle(within_s=60.0)
        stream.outbox.put_nowait(None)


class WorkerAdminServicer(admin_pb2_grpc.WorkerAdminServicer):
    """`sluice.v1.WorkerAdmin`: drain and status for operators."""

    def __init__(
        self,
        state: WorkerState,
        drain: Callable[[], Coroutine[Any, Any, None]],
        status: Callable[[], admin_pb2.WorkerStatusResponse],
        clock: Clock,
    ) -> None:
        self._state = state
        self._clock = clock
        self._drain = drain
        self._status = status
        self._drain_task: asyncio.Task[None] | None = None

    async def Drain(self, request: admin_pb2.DrainRequest, context: Context) -> admin_pb2.DrainResponse:
        """Start draining (once); optionally wait for it to finish."""
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        if request.wait_s > 0:
            await wait_until(self._clock, {self._drain_task}, self._clock.now() + request.wait_s)
        return admin_pb2.DrainResponse(
            state=self._state.state, in_flight_batches=self._state.runner.pending_batches
        )

    async def Status(
        self, request: admin_pb2.WorkerStatusRequest, context: Context
    ) -> admin_pb2.WorkerStatusResponse:
        """Identity, models, state and load."""
        return self._status()
