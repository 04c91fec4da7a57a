"""Prefix watches that survive etcd outages: a stream of whole snapshots of one key prefix.

Invariants: whole snapshots, never deltas, so a consumer that missed one is never wrong for long; nothing
is yielded while etcd is unreachable (callers keep serving from their last view, DESIGN.md §6); once etcd
answers again the prefix is re-read (yielded if it changed) and re-watched from the read's revision + 1,
so no event between the read and the watch is lost. aetcd does not reconnect a broken watch, so every
failure drops the client and opens a fresh one after a bounded backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aetcd
import aetcd.exceptions

from common.config import EtcdSettings
from common.etcd import ETCD_ERRORS, WATCH_BACKOFF_S, Backoff, EtcdUnavailable, close_client, open_client

logger = logging.getLogger(__name__)


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
            try:
                await events.aclose()
            except ETCD_ERRORS as exc:
                logger.debug("etcd: closing the watch of %s: %r", self._prefix, exc)
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
