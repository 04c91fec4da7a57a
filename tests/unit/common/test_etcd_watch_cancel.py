"""A watch ends when its task is cancelled, even when the etcd client turns the cancel into its own error."""

from __future__ import annotations

import asyncio
import contextlib

import aetcd
import pytest

from sluice_inference.common import etcd_watch
from sluice_inference.common.clock import MonotonicClock
from sluice_inference.common.etcd import LeasedKey
from sluice_inference.common.etcd_watch import WatchHealth, follow_prefix
from sluice_inference.common.trust_settings import EtcdSettings


async def test_a_cancel_the_client_reports_as_its_own_error_still_ends_the_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[int] = []
    reading = asyncio.Event()

    async def read(self: object) -> int:
        """An etcd read that answers the first cancel with ConnectionFailedError, as aetcd can."""
        reads.append(1)
        reading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if len(reads) == 1:
                raise aetcd.exceptions.ConnectionFailedError("the call was cancelled") from None
            raise
        return 0

    monkeypatch.setattr(etcd_watch._PrefixSession, "read", read)
    settings = EtcdSettings()
    follow = follow_prefix(
        settings, settings.prefix + "routers/", lambda _: None, WatchHealth("routers"), MonotonicClock()
    )
    task = asyncio.create_task(follow)
    try:
        await asyncio.wait_for(reading.wait(), 5.0)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2.0)
        assert task in done and task.cancelled()  # not a fresh read after a backoff: the stop is honoured
        assert len(reads) == 1
    finally:
        task.cancel()  # a watch that outlived its stop goes now (a second cancel is not swallowed)
        with contextlib.suppress(asyncio.CancelledError):
            await task


class _CancelledPut:
    """An etcd client whose put answers its cancel with ConnectionFailedError, as aetcd can."""

    def __init__(self) -> None:
        self.putting = asyncio.Event()

    async def put(self, key: bytes, value: bytes, lease: int) -> None:
        self.putting.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise aetcd.exceptions.ConnectionFailedError("the call was cancelled") from None


async def test_an_update_cancelled_under_the_client_is_cancelled_not_taken_for_an_outage() -> None:
    key = LeasedKey(EtcdSettings(), "/sluice/routers/r1", b"{}")
    client = _CancelledPut()
    key._client, key._lease_id = client, 7  # registered, as `start` leaves it
    task = asyncio.create_task(key.update(b'{"demand": 1}'))
    await asyncio.wait_for(client.putting.wait(), 5.0)
    task.cancel()
    await asyncio.wait({task}, timeout=2.0)
    assert task.cancelled()  # the publish loop awaiting it ends, instead of going on past its stop


class _CancelledRefresh:
    """An etcd client whose lease refresh answers its cancel with ConnectionFailedError, as aetcd can."""

    def __init__(self) -> None:
        self.refreshing = asyncio.Event()
        self.closed = False

    async def refresh_lease(self, lease_id: int) -> None:
        self.refreshing.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise aetcd.exceptions.ConnectionFailedError("the call was cancelled") from None

    async def close(self) -> None:
        self.closed = True


async def test_a_keepalive_round_cancelled_under_the_client_is_cancelled_not_taken_for_an_outage() -> None:
    """`revoke` cancels the keepalive task and waits for it: a round that took the cancel for an outage
    would go back to sleep and the revoke (and the stop awaiting it) would never return."""
    key = LeasedKey(EtcdSettings(), "/sluice/workers/w1", b"{}")
    client = _CancelledRefresh()
    key._client, key._lease_id, key._connected = client, 7, True
    task = asyncio.create_task(key._beat())
    await asyncio.wait_for(client.refreshing.wait(), 5.0)
    task.cancel()
    await asyncio.wait({task}, timeout=2.0)
    assert task.cancelled()
