"""Prefix watches that survive etcd outages: a stream of whole snapshots of one key prefix.

Invariants: whole snapshots, never deltas, so a consumer that missed one is never wrong for long; nothing
is yielded while etcd is unreachable (callers keep serving from their last view, docs/design.md §6); once etcd
answers again the prefix is re-read (yielded if it changed) and re-watched from the read's revision + 1,
so no event between the read and the watch is lost. aetcd does not reconnect a broken watch, so every
failure drops the client and opens a fresh one after a bounded backoff.

What etcd holds is a claim written by whoever can write it, not trusted input (docs/security.md). So the
consumers follow a prefix through `follow_prefix`, which survives anything a value or a consumer does:
values over `MAX_VALUE_BYTES` never reach the consumer, a consumer that raises is logged (rate-limited) and
restarted on a fresh snapshot after a backoff, and a `WatchHealth` says at every moment whether the
consumer is applying what etcd holds, for health and metrics. `decode_json_value` is the one defensive
JSON reader of such values: any malformed, oversized or absurdly nested value is a `ValueError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection
from dataclasses import dataclass
from typing import Any

import aetcd
import aetcd.exceptions

from sluice_inference.common.clock import Clock, cancel_until_done
from sluice_inference.common.etcd import (
    ETCD_ERRORS,
    WATCH_BACKOFF_S,
    Backoff,
    EtcdUnavailable,
    close_client,
    close_within,
    open_client,
    raise_if_cancelling,
)
from sluice_inference.common.logs import LogThrottle
from sluice_inference.common.trust_settings import EtcdSettings

logger = logging.getLogger(__name__)

MAX_VALUE_BYTES = 256 * 1024
"""Largest value under a watched prefix that a consumer is shown (ours are < 16 KiB: a worker record with
dozens of models); larger ones are skipped and counted, so a writer cannot make every router parse
megabytes on every change."""
WATCH_CLOSE_TIMEOUT_S = 1.0
"""Bound on cancelling a watch when it is dropped: aetcd's close waits for etcd, and an unbounded one held a
router's stop past its 5 s step on a loaded machine (the client is closed next, within its own bound)."""
WATCH_STOP_S = 4.0
"""How long `stop_watch_tasks` waits for the tasks of a process's watches to end: under a router's 5 s stop
step."""
WATCH_RECANCEL_S = 1.5
"""How long a cancelled watch task gets to wind down before it is cancelled again: over
`WATCH_CLOSE_TIMEOUT_S`, the bound on what it closes as it ends."""
LOG_INTERVAL_S = 10.0
"""At most one log line per watch and interval about skipped values or a failing consumer."""


class _PrefixSession:
    """The client, watch and last snapshot behind one `watch_prefix_snapshots` generator."""

    def __init__(self, settings: EtcdSettings, prefix: str) -> None:
        self._settings = settings
        self._prefix = prefix
        self._prefix_bytes = prefix.encode()
        self._client: aetcd.Client | None = None
        self._events: Any = None  # the aetcd watch iterator (an async generator)
        self.view: dict[str, bytes] | None = None
        self.healthy = True

    def _name(self, key: bytes) -> str:
        return key[len(self._prefix_bytes) :].decode("utf-8", errors="replace")

    async def read(self) -> int:
        """Replace `view` with the prefix's contents; returns the revision of the read."""
        if self._client is None:
            self._client = await open_client(self._settings)
        result = await self._client.get_prefix(self._prefix_bytes)
        self.view = {self._name(kv.key): bytes(kv.value) for kv in result}
        return int(result.header.revision)

    async def watch(self, start_revision: int) -> AsyncIterator[Any]:
        """Open a watch on the prefix from `start_revision`; returns its event iterator."""
        assert self._client is not None, "read() opens the client first"
        watch = await self._client.watch_prefix(self._prefix_bytes, start_revision=start_revision)
        events: AsyncIterator[Any] = aiter(watch)
        self._events = events
        return events

    def apply(self, event: Any) -> None:
        """Fold one PUT or DELETE event into `view`."""
        assert self.view is not None
        name = self._name(event.kv.key)
        if event.kind == aetcd.rtypes.EventKind.PUT:
            self.view[name] = bytes(event.kv.value)
        else:
            self.view.pop(name, None)

    def failed(self, exc: BaseException) -> None:
        """Note a broken read or watch; warns once per outage."""
        if self.healthy:
            logger.warning("etcd: watch of %s broke (%r); retrying with backoff", self._prefix, exc)
        self.healthy = False

    def recovered(self) -> None:
        """Note a re-established watch."""
        if not self.healthy:
            logger.warning("etcd: watch of %s re-established", self._prefix)
        self.healthy = True

    async def reset(self) -> None:
        """Drop the watch and the client; the next `read()` opens a fresh client."""
        events, self._events = self._events, None
        if events is not None:
            await close_within(events.aclose(), WATCH_CLOSE_TIMEOUT_S, f"the watch of {self._prefix}")
        client, self._client = self._client, None
        if client is not None:
            await close_client(client)


async def watch_prefix_snapshots(
    settings: EtcdSettings, prefix: str
) -> AsyncGenerator[dict[str, bytes], None]:
    """Yield the full contents of `prefix` (names with the prefix stripped → values): once at the
    start, then after every change (puts, deletes, lease expiries).

    `prefix` is a full key prefix inside the registry, e.g. `settings.prefix + WORKERS`. While etcd is
    unreachable nothing is yielded; when it answers again the prefix is re-read (and yielded if it
    changed) and watched from there. Closing the generator (or cancelling its task) closes the client.
    """
    if not prefix.startswith(settings.prefix):
        raise ValueError(f"watch prefix {prefix!r} is outside the registry prefix {settings.prefix!r}")
    session = _PrefixSession(settings, prefix)
    backoff = Backoff(*WATCH_BACKOFF_S)
    try:
        while True:
            last = session.view
            try:
                revision = await session.read()
                if session.view != last:
                    yield dict(session.view or {})
                events = await session.watch(revision + 1)
                session.recovered()
                backoff.reset()
                async for event in events:
                    session.apply(event)
                    yield dict(session.view or {})
                raise EtcdUnavailable("the watch stream ended")
            except aetcd.exceptions.RevisionCompactedError as exc:
                # Not an outage: the history we asked for is gone, so take a fresh snapshot.
                logger.info("etcd: watch of %s fell behind compaction (%s); re-reading", prefix, exc)
                await session.reset()
            except Exception as exc:
                raise_if_cancelling()  # the client turned our cancel into an error of its own
                if isinstance(exc, ETCD_ERRORS):
                    session.failed(exc)
                else:
                    # A bug (ours or aetcd's) must not end the watch routers depend on: log, start over.
                    logger.exception("etcd: unexpected error watching %s; retrying", prefix)
                    session.healthy = False
                await session.reset()
                await asyncio.sleep(backoff.delay())
    finally:
        await session.reset()


def decode_json_value(raw: bytes, *, what: str) -> object:
    """Parse one JSON value read from etcd, or raise ValueError saying what is wrong with it.

    Rejects values over `MAX_VALUE_BYTES` and nesting deep enough to exhaust the parser's recursion
    (100,000 `[` raised RecursionError, which ended the watcher that read it)."""
    if len(raw) > MAX_VALUE_BYTES:
        raise ValueError(f"{what}: {len(raw)} bytes, over the {MAX_VALUE_BYTES}-byte limit")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError(f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what}: not JSON ({exc})") from None


@dataclass
class WatchHealth:
    """Whether one followed prefix is being applied: False from a failure of its consumer until a fresh
    snapshot has been applied again (and before the first one). An etcd outage leaves it as it was: the
    process keeps serving from its last view (docs/design.md §6)."""

    name: str
    running: bool = False
    restarts: int = 0
    """How often the consumer raised and was started over."""
    skipped: int = 0
    """Values not shown to the consumer (over `MAX_VALUE_BYTES`)."""


async def follow_prefix(
    settings: EtcdSettings,
    prefix: str,
    apply: Callable[[dict[str, bytes]], None],
    health: WatchHealth,
    clock: Clock,
) -> None:
    """Call `apply` with every snapshot of `prefix` (see `watch_prefix_snapshots`) until cancelled.

    Oversized values are left out of the snapshot (counted in `health.skipped`); if `apply` raises, the
    error is logged at most once per `LOG_INTERVAL_S`, `health.running` turns False, and after a backoff
    the prefix is read afresh and applied again, so no value and no bug in a consumer ends the watch."""
    throttle = LogThrottle(logger, LOG_INTERVAL_S, clock)
    backoff = Backoff(*WATCH_BACKOFF_S)
    while True:
        snapshots = watch_prefix_snapshots(settings, prefix)
        try:
            async with contextlib.aclosing(snapshots):
                async for snapshot in snapshots:
                    apply(_within_limit(snapshot, health, throttle))
                    health.running = True
                    backoff.reset()
        except Exception as exc:
            raise_if_cancelling()
            health.running = False
            health.restarts += 1
            throttle.warning("watch of %s: its consumer failed (%r); starting over", prefix, exc)
        await clock.sleep(backoff.delay())


def _within_limit(snapshot: dict[str, bytes], health: WatchHealth, throttle: LogThrottle) -> dict[str, bytes]:
    kept = {name: raw for name, raw in snapshot.items() if len(raw) <= MAX_VALUE_BYTES}
    if len(kept) < len(snapshot):
        health.skipped += len(snapshot) - len(kept)
        throttle.warning(
            "watch of %s: skipping %d value(s) over %d bytes",
            health.name, len(snapshot) - len(kept), MAX_VALUE_BYTES,
        )  # fmt: skip
    return kept


async def stop_watch_tasks(clock: Clock, tasks: Collection[asyncio.Task[Any]], what: str) -> None:
    """Cancel the tasks that follow `what`'s watches until they end (`cancel_until_done`: aetcd can swallow
    a cancel), for at most `WATCH_STOP_S`; one still running then is left behind, logged."""
    left = await cancel_until_done(clock, tasks, WATCH_STOP_S, WATCH_RECANCEL_S)
    if left:
        names = ", ".join(sorted(task.get_name() for task in left))
        logger.warning("%s: %s did not stop within %.1f s; left behind", what, names, WATCH_STOP_S)
