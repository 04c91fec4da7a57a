"""One bidirectional stream to one worker (docs/design.md §2: sluice/v1/worker.proto), and the set of them.

A link only moves messages: `send` queues a RouterMessage for the writer, every WorkerMessage read is
handed to `on_message` (the driver), the first one also to `on_up`, and when the stream ends for any
reason `on_closed` is called exactly once with the link itself (so a stale link can be told from the
current one).
Before the stream opens, the worker proves it is the worker its etcd record claims (common/cluster_auth.py:
under mTLS its certificate names the id, with a token it answers a challenge); an address that cannot is
sent nothing but a nonce, and the link closes with the reason.
A killed peer's socket closes at once; a frozen or cut-off one goes silent, and the link closes its own
stream once the worker's heartbeat is overdue (common/heartbeat.py: 0.8 s after the last message of a
busy worker, which reports every 0.25 s; an idle one's announced interval plus 0.55 s, but 0.8 s from a
batch sent to it): one timer on the injected clock, re-armed from the last message when it fires, not a
poll and not one timer per message (`SilenceWatch`). The link tells the worker it reads the announced
interval in the stream's metadata. The verdict is the worker's, not the router's own: a timer that runs
late means the router's loop was held up, and the messages of that time may still be waiting to be read.
gRPC keepalive pings every 500 ms with a 500 ms ack deadline back that up (gRPC alone takes ~1.5 s).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from sluice_inference.common.clock import Clock, Timer
from sluice_inference.common.cluster_auth import STREAM_METHOD, ClusterClient
from sluice_inference.common.cluster_proof import IdentityNotProven
from sluice_inference.common.heartbeat import (
    REPORT_INTERVAL_METADATA,
    STREAM_SILENCE_S,
    silence_bound_s,
)
from sluice_inference.common.pb.sluice.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

LATE_S = 0.05
"""A silence timer that runs this long after it was due found the router's own event loop held up."""
STALL_GRACE_S = 0.3
"""How much longer a stream found silent by a late timer is given, once per silence, for messages that
came in while the router's loop was held up to be read (more than a load report's interval)."""

KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 500),
    ("grpc.keepalive_timeout_ms", 500),
    ("grpc.http2.ping_timeout_ms", 500),  # grpcio 1.85 enforces the ping-ack deadline with this one
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

OnMessage = Callable[[str, worker_pb2.WorkerMessage], None]
OnUp = Callable[[str], None]
OnClosed = Callable[["WorkerLink", str], None]


class SilenceWatch:
    """Whether a worker's stream has been silent too long, on one timer of the injected clock.

    How long is the worker's to say (common/heartbeat.py): each load report announces when the next one
    is due, and the stream may stay silent `SILENCE_MARGIN_S` past that, never less than
    `STREAM_SILENCE_S`. A batch sent while the worker reports slowly (it was idle) is answered sooner: the
    worker must speak within `STREAM_SILENCE_S` of the send, by a result or a report at the busy pace. A
    slow report read after the send does not count, as it may have crossed the batch on the way.
    The timer is set from the first message and, when it fires, re-armed from the latest one (or brought
    forward by a send). A timer that fires more than `LATE_S` after it was due found the router's own
    loop held up (a collection, a stalled machine, a busy caller sharing the loop): the worker's messages
    of that time may be waiting unread behind the timer, so it looks again `STALL_GRACE_S` later before
    calling the stream silent. Once per silence: a router whose every timer runs late still closes a dead
    worker's stream within its bound plus `STALL_GRACE_S` and two lateness. A fresh-clone run closed both
    workers' streams at once, and failed 15 requests, when the test's router and its load generator shared
    a stalled loop."""

    def __init__(self, clock: Clock, on_silent: Callable[[], None]) -> None:
        self.last_message = 0.0
        """Clock time of the last message from the worker (its heartbeat)."""
        self._clock = clock
        self._on_silent = on_silent
        self._bound = STREAM_SILENCE_S
        """How long the stream may stay silent after its last message (the latest report's announcement)."""
        self._answer_by: float | None = None
        """A batch went to a slowly reporting worker: its next result or busy-pace report is due by then."""
        self._timer: Timer | None = None
        self._due = 0.0
        self._excused = False
        self._stopped = False

    def heard(self, report_interval_ms: int | None = None) -> None:
        """A message came: a load report announcing `report_interval_ms`, or results (None). The first
        message starts the watch."""
        self.last_message = self._clock.now()
        if report_interval_ms is not None:
            self._bound = silence_bound_s(report_interval_ms)
            if self._bound <= STREAM_SILENCE_S:
                self._answer_by = None
        else:  # results: the worker was sent batches, so it reports at the busy pace
            self._bound = STREAM_SILENCE_S
            self._answer_by = None
        if self._timer is None and not self._stopped:
            self._arm(self._quiet_until())

    def sent(self) -> None:
        """Batches went to the worker (one comparison while it reports at the busy pace)."""
        if self._bound <= STREAM_SILENCE_S or self._answer_by is not None or self._stopped:
            return
        self._answer_by = self._clock.now() + STREAM_SILENCE_S
        if self._timer is not None and self._answer_by < self._due:
            self._timer.cancel()
            self._arm(self._answer_by)

    def silent_for(self) -> float:
        """Seconds since the last message."""
        return self._clock.now() - self.last_message

    def stop(self) -> None:
        """No verdict from now on."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _quiet_until(self) -> float:
        until = self.last_message + self._bound
        return until if self._answer_by is None else min(until, self._answer_by)

    def _arm(self, due: float) -> None:
        self._due = due
        self._timer = self._clock.call_at(due, self._fired)

    def _fired(self) -> None:
        self._timer = None
        if self._stopped:
            return
        now = self._clock.now()
        if now < (until := self._quiet_until()):  # heard since: look again when that runs out
            self._excused = False
            self._arm(until)
        elif now - self._due > LATE_S and not self._excused:
            self._excused = True
            self._arm(now + STALL_GRACE_S)
        else:
            self._stopped = True
            self._on_silent()


class WorkerLink:
    """The router's end of the stream to one worker."""

    def __init__(
        self,
        worker_id: str,
        addr: str,
        *,
        on_message: OnMessage,
        on_up: OnUp,
        on_closed: OnClosed,
        cluster: ClusterClient,
        clock: Clock,
    ) -> None:
        self.worker_id = worker_id
        self.addr = addr
        self.ready = False
        """A first message came: the worker is there."""
        self.last_load: worker_pb2.LoadReport | None = None
        """The worker's latest load report (the admin view shows it)."""
        self._on_message = on_message
        self._on_up = on_up
        self._on_closed = on_closed
        self._cluster = cluster
        self._silence = SilenceWatch(clock, self._went_silent)
        self._silent = False
        """The stream was closed because the worker went silent."""
        self._silent_for = 0.0
        self._options = [
            *KEEPALIVE_OPTIONS,
            ("grpc.max_send_message_length", cluster.max_message_bytes),
            ("grpc.max_receive_message_length", cluster.max_message_bytes),
        ]
        self._outbox: asyncio.Queue[worker_pb2.RouterMessage | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether the stream has ended (no more messages will be sent or read)."""
        return self._closed

    def start(self) -> None:
        """Open the stream in the background."""
        self._task = asyncio.create_task(self._run(), name=f"worker-link-{self.worker_id}")

    def send(self, message: worker_pb2.RouterMessage) -> bool:
        """Queue a message for the worker; False when the link is closed."""
        if self._closed:
            return False
        if message.batches:
            self._silence.sent()
        self._outbox.put_nowait(message)
        return True

    async def close(self) -> None:
        """End the stream and wait for the reader (on_closed still fires once)."""
        self._outbox.put_nowait(None)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _requests(self) -> AsyncIterator[worker_pb2.RouterMessage]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _run(self) -> None:
        reason = "stream ended"
        try:
            async with self._cluster.channel(self.addr, self.worker_id, self._options) as channel:
                metadata = await self._cluster.authenticate(channel, self.worker_id, STREAM_METHOD)
                metadata = (*metadata, (REPORT_INTERVAL_METADATA, "1"))
                call = worker_pb2_grpc.WorkerStub(channel).Stream(self._requests(), metadata=metadata)
                async for message in call:
                    if message.HasField("load"):
                        self.last_load = message.load
                        self._silence.heard(message.load.report_interval_ms)
                    else:
                        self._silence.heard()
                    if not self.ready:
                        self.ready = True
                        self._on_up(self.worker_id)
                    self._on_message(self.worker_id, message)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except IdentityNotProven as exc:
            reason = f"{self.addr} did not prove it is worker {self.worker_id}: {exc}"
        except asyncio.CancelledError:
            reason = f"silent for {self._silent_for:.2f} s" if self._silent else "closed by router"
        finally:
            self._silence.stop()
            self._closed = True
            self.ready = False
            self._outbox.put_nowait(None)  # ends the request generator, rather than leaving it to the GC
            self._on_closed(self, reason)

    def _went_silent(self) -> None:
        """The watch found the worker silent: close the stream (its batches are re-dispatched)."""
        if self._closed:
            return
        self._silent_for = self._silence.silent_for()
        log.warning("worker %s silent for %.2f s: closing its stream", self.worker_id, self._silent_for)
        self._silent = True
        if self._task is not None:
            self._task.cancel()


class WorkerLinks:
    """The live links of this router, by worker id."""

    def __init__(self) -> None:
        self._links: dict[str, WorkerLink] = {}

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._links

    def get(self, worker_id: str) -> WorkerLink | None:
        """The link to a worker, if open."""
        return self._links.get(worker_id)

    def add(self, link: WorkerLink) -> None:
        """Track a started link."""
        self._links[link.worker_id] = link

    def pop(self, worker_id: str) -> WorkerLink | None:
        """Stop tracking a link."""
        return self._links.pop(worker_id, None)

    def ids(self) -> list[str]:
        """Workers with a link."""
        return list(self._links)

    def send(self, worker_id: str, message: worker_pb2.RouterMessage) -> bool:
        """Send to a worker; False if there is no open link."""
        link = self._links.get(worker_id)
        return link is not None and link.send(message)
