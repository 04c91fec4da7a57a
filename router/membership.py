"""Keeps the router's streams equal to etcd's `workers/` prefix, and tells the core what changed.

It decides nothing about batches: which workers take them, and how many, is the core's (a worker accepts
while its record is ready, its stream is up and its reports say READY). Events and what they become:
- a record appears or changes → `worker_registered` (models with their warm-up timings, capacity, ready
  or draining); a new record or address → a new stream;
- a stream's first message → `worker_connected`; every answer and load report goes from the stream
  straight to the driver, never through here;
- a record disappears (drain finished, or lease expired after SIGKILL/SIGSTOP) → no new batches; the
  stream is closed once in-flight batches are answered, or after `RETIRE_GRACE_S`; then `worker_left`,
  once;
- the current stream of a registered worker breaks → `worker_left` (its requests go elsewhere or end
  UNAVAILABLE) and the stream is reopened with backoff; a stale stream that closes changes nothing.
If etcd is unreachable no snapshot arrives and the router keeps serving from its last view. A record that
cannot be read is skipped (never a half-read worker), and the watch itself survives any value and any
failure here (`follow_prefix`); `watch` says whether it is being applied.
"""

from __future__ import annotations

import asyncio
import logging

from sluice_inference.common.clock import Clock
from sluice_inference.common.cluster_auth import ClusterClient
from sluice_inference.common.etcd import WORKERS
from sluice_inference.common.etcd_watch import WatchHealth, follow_prefix, stop_watch_tasks
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.records import WorkerRecord
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.driver import Driver
from sluice_inference.router.policy.catalog import ModelCatalog
from sluice_inference.router.worker_link import WorkerLink, WorkerLinks

log = logging.getLogger(__name__)

RETIRE_GRACE_S = 1.0
RECONNECT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)


class Membership:
    """Reconciles etcd's worker records with worker links, and tells the driver what changed."""

    def __init__(
        self,
        etcd: EtcdSettings,
        driver: Driver,
        links: WorkerLinks,
        catalog: ModelCatalog,
        *,
        cluster: ClusterClient,
        clock: Clock,
    ) -> None:
        self._etcd = etcd
        self._clock = clock
        self.watch = WatchHealth("workers")
        """Whether `workers/` is being applied (router/status.py turns it into health)."""
        self._cluster = cluster
        self._driver = driver
        self._links = links
        self._catalog = catalog
        self.records: dict[str, WorkerRecord] = {}
        self._failures: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Watch etcd in the background (each link watches its own stream's heartbeat)."""
        self._watch = asyncio.create_task(self._follow(), name="membership-watch")

    async def stop(self) -> None:
        """Stop watching and close every stream."""
        tasks = [t for t in (self._watch, *self._tasks) if t is not None]
        await stop_watch_tasks(self._clock, tasks, "membership")
        for worker_id in self._links.ids():
            link = self._links.pop(worker_id)
            if link is not None:
                await link.close()

    async def _follow(self) -> None:
        def apply(snapshot: dict[str, bytes]) -> None:
            self.apply(self._parse(snapshot))

        await follow_prefix(self._etcd, self._etcd.prefix + WORKERS, apply, self.watch, self._clock)

    @staticmethod
    def _parse(snapshot: dict[str, bytes]) -> dict[str, WorkerRecord]:
        records = {}
        for key, raw in snapshot.items():
            try:
                records[key] = WorkerRecord.from_json(raw)
            except ValueError as exc:  # pydantic's ValidationError is a ValueError
                log.error("ignoring malformed worker record %r: %s", key[:64], str(exc)[:200])
        return records

    # -- reconciliation -----------------------------------------------------------------------------------
    def apply(self, records: dict[str, WorkerRecord]) -> None:
        """Make links and the core's workers match `records`."""
        previous, self.records = self.records, records
        self._catalog.update(records)
        for conflict in self._catalog.conflicts():
            log.warning("model registrations disagree (a redeploy in progress?): %s", conflict)
        for worker_id in previous.keys() - records.keys():
            self._spawn(self._retire(worker_id))
        for worker_id, record in records.items():
            old = previous.get(worker_id)
            if old is None or old.addr != record.addr or worker_id not in self._links:
                self._connect(record)
            elif old != record:
                self._register(record)

    def _register(self, record: WorkerRecord) -> None:
        self._driver.worker_registered(
            record.worker_id,
            {(m.name, m.version): m.warmup_s for m in record.models},
            record.capacity,
            record.state == "ready",
            record.device,
        )

    def _connect(self, record: WorkerRecord) -> None:
        stale = self._links.pop(record.worker_id)
        if stale is not None:
            self._spawn(stale.close())
        self._register(record)
        link = WorkerLink(
            record.worker_id,
            record.addr,
            on_message=self._driver.on_message,
            on_up=self._on_up,
            on_closed=self._on_closed,
            cluster=self._cluster,
            clock=self._clock,
        )
        self._links.add(link)
        link.start()

    async def _retire(self, worker_id: str) -> None:
        """The record is gone (drained, or its lease expired): no new batches; the stream closes once the
        batches in flight are answered, or after `RETIRE_GRACE_S`; then the worker leaves the core (once)."""
        self._driver.worker_connected(worker_id, False)
        await self._driver.wait_answered(worker_id, RETIRE_GRACE_S)
        if worker_id in self.records:
            return  # it came back (re-registered) while we waited
        link = self._links.pop(worker_id)
        if link is not None:
            await link.close()
        self._driver.worker_left(worker_id, "deregistered from etcd")

    # -- stream events ------------------------------------------------------------------------------------
    def _on_up(self, worker_id: str) -> None:
        self._failures.pop(worker_id, None)
        self._driver.worker_connected(worker_id, True)

    def _on_closed(self, link: WorkerLink, reason: str) -> None:
        worker_id = link.worker_id
        if self._links.get(worker_id) is not link:
            return  # retired on purpose, or a newer link replaced this one: nothing is lost
        self._links.pop(worker_id)
        self._driver.worker_left(worker_id, reason)
        record = self.records.get(worker_id)
        if record is None:
            return
        failures = self._failures.get(worker_id, 0)
        self._failures[worker_id] = failures + 1
        delay = RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
        log.warning("stream to worker %s closed (%s); reconnecting in %.1f s", worker_id, reason, delay)
        self._spawn(self._reconnect(worker_id, delay))

    async def _reconnect(self, worker_id: str, delay: float) -> None:
        await self._clock.sleep(delay)
        record = self.records.get(worker_id)
        if record is not None and worker_id not in self._links:
            self._connect(record)

    def load_of(self, worker_id: str) -> worker_pb2.LoadReport | None:
        """The latest load report on the worker's stream (None: not connected yet)."""
        link = self._links.get(worker_id)
        return None if link is None else link.last_load

    def _spawn(self, coro: object) -> None:
        assert asyncio.iscoroutine(coro)
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
