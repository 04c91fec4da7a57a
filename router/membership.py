"""Keeps the router's set of workers equal to etcd's `workers/` prefix, and one stream open to each.

Events and what they do:
- a record appears → open a stream; the worker accepts batches once its first READY load report arrives
  (so it gets traffic within ~1 s of registering);
- a record turns `draining` or a load report says DRAINING → no new batches, in-flight ones finish;
- a record disappears (drain finished, or lease expired after SIGKILL/SIGSTOP) → no new batches; the
  stream is closed once in-flight batches are answered, or after `RETIRE_GRACE_S`, whichever comes first;
- a stream breaks while the record is still there → its in-flight requests end UNAVAILABLE (retryable)
  and the stream is reopened with backoff.
If etcd is unreachable no snapshot arrives and the router keeps serving from its last view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pydantic import ValidationError

from common.cluster_auth import ClusterClient
from common.config import EtcdSettings, RouterSettings
from common.etcd import WORKERS
from common.etcd_watch import watch_prefix_snapshots
from common.pb.sluice.v1 import worker_pb2
from common.records import WorkerRecord
from router.driver import Driver
from router.policy.catalog import ModelCatalog
from router.worker_link import WorkerLink, WorkerLinks

log = logging.getLogger(__name__)

RETIRE_GRACE_S = 1.0
STREAM_SILENCE_S = 0.8
"""A worker reports its load every 0.25 s; a stream silent this long belongs to a frozen or cut-off
worker (gRPC keepalive alone takes ~1.5 s to say so), so it is closed and its batches re-dispatched."""
RECONNECT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)


class Membership:
    """Reconciles etcd's worker records with worker links and the driver's worker pool."""

    def __init__(
        self,
        etcd: EtcdSettings,
        settings: RouterSettings,
        driver: Driver,
        links: WorkerLinks,
        catalog: ModelCatalog,
        *,
        cluster: ClusterClient,
    ) -> None:
        self._etcd = etcd
        self._cluster = cluster
        self._settings = settings
        self._driver = driver
        self._links = links
        self._catalog = catalog
        self.records: dict[str, WorkerRecord] = {}
        self.loads: dict[str, worker_pb2.LoadReport] = {}
        self._failures: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Watch etcd, and the streams' heartbeats, in the background."""
        self._watch = asyncio.create_task(self._follow(), name="membership-watch")
        self._spawn(self._watch_heartbeats())

    async def _watch_heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.1)
            for worker_id in self._links.ids():
                link = self._links.get(worker_id)
                if link is not None and link.ready and loop.time() - link.last_message > STREAM_SILENCE_S:
                    log.warning(
                        "worker %s silent for %.2f s: closing its stream", worker_id, STREAM_SILENCE_S
                    )
                    self._spawn(link.close())

    async def stop(self) -> None:
        """Stop watching and close every stream."""
        tasks = [t for t in (self._watch, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker_id in self._links.ids():
            link = self._links.pop(worker_id)
            if link is not None:
                await link.close()

    async def _follow(self) -> None:
        snapshots = watch_prefix_snapshots(self._etcd, self._etcd.prefix + WORKERS)
        async with contextlib.aclosing(snapshots):
            async for snapshot in snapshots:
                self.apply(self._parse(snapshot))

    @staticmethod
    def _parse(snapshot: dict[str, bytes]) -> dict[str, WorkerRecord]:
        records = {}
        for key, raw in snapshot.items():
            try:
                records[key] = WorkerRecord.from_json(raw)
            except ValidationError as exc:
                log.error("ignoring malformed worker record %r: %s", key, exc)
        return records

    # -- reconciliation -----------------------------------------------------------------------------------
    def apply(self, records: dict[str, WorkerRecord]) -> None:
        """Make links and the worker pool match `records`."""
        previous, self.records = self.records, records
        self._catalog.update(records)
        for conflict in self._catalog.conflicts():
            log.warning("model registrations disagree (a redeploy in progress?): %s", conflict)
        for record in records.values():
            for model in record.models:
                self._driver.estimates.seed(model.name, model.version, model.warmup_s)
        for worker_id in previous.keys() - records.keys():
            self._spawn(self._retire(worker_id))
        for worker_id, record in records.items():
            old = previous.get(worker_id)
            if old is None or old.addr != record.addr or worker_id not in self._links:
                self._connect(record)
            elif old.models != record.models or old.capacity != record.capacity:
                self._join(record)
            self._update_accepting(worker_id)

    def _join(self, record: WorkerRecord) -> None:
        capacity = min(record.capacity, self._settings.batches_in_flight_per_worker)
        models = {(m.name, m.version) for m in record.models}
        self._driver.worker_joined(record.worker_id, models, capacity)

    def _connect(self, record: WorkerRecord) -> None:
        stale = self._links.pop(record.worker_id)
        if stale is not None:
            self._spawn(stale.close())
        self._join(record)
        link = WorkerLink(
            record.worker_id,
            record.addr,
            self._on_message,
            self._on_closed,
            self._cluster,
        )
        self._links.add(link)
        link.start()

    def _update_accepting(self, worker_id: str) -> None:
        record = self.records.get(worker_id)
        link = self._links.get(worker_id)
        load = self.loads.get(worker_id)
        accepting = (
            record is not None
            and record.state == "ready"
            and link is not None
            and link.ready
            and (load is None or load.state == worker_pb2.WORKER_STATE_READY)
        )
        self._driver.worker_accepting(worker_id, accepting)

    async def _retire(self, worker_id: str) -> None:
        self._driver.worker_accepting(worker_id, False)
        await self._driver.wait_answered(worker_id, RETIRE_GRACE_S)
        if worker_id in self.records:
            return  # it came back (re-registered) while we waited
        self.loads.pop(worker_id, None)
        link = self._links.pop(worker_id)
        if link is not None:
            await link.close()
        self._driver.worker_lost(worker_id, "deregistered from etcd")

    # -- stream events ------------------------------------------------------------------------------------
    def _on_message(self, worker_id: str, message: worker_pb2.WorkerMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "result":
            self._driver.on_result(worker_id, message.result)
        elif kind == "load":
            self.loads[worker_id] = message.load
            link = self._links.get(worker_id)
            if link is not None:
                link.ready = True
            self._failures.pop(worker_id, None)
            self._update_accepting(worker_id)

    def _on_closed(self, worker_id: str, reason: str) -> None:
        self._driver.worker_lost(worker_id, reason)
        record = self.records.get(worker_id)
        if record is None:
            return  # retired on purpose
        current = self._links.get(worker_id)
        if current is not None and not current.closed:
            self._join(record)  # a newer link replaced the one that closed
            self._update_accepting(worker_id)
            return
        self._links.pop(worker_id)
        failures = self._failures.get(worker_id, 0)
        self._failures[worker_id] = failures + 1
        delay = RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
        log.warning("stream to worker %s closed (%s); reconnecting in %.1f s", worker_id, reason, delay)
        self._spawn(self._reconnect(worker_id, delay))

    async def _reconnect(self, worker_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        record = self.records.get(worker_id)
        if record is not None and worker_id not in self._links:
            self._connect(record)
            self._update_accepting(worker_id)

    def _spawn(self, coro: object) -> None:
        assert asyncio.iscoroutine(coro)
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- views --------------------------------------------------------------------------------------------
    def accepting_workers(self) -> list[str]:
        """Workers that currently receive batches."""
        return [w.worker_id for w in self._driver.dispatcher.workers if w.accepting]
