"""common/etcd.py against a real etcd: leased registrations and prefix watches, through outages.

Every wait is a poll with a deadline; the deadlines follow from the lease TTL (2 s here) and the
keepalive period (TTL/3), so a slow machine fails with a message rather than hanging.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from sluice_inference.common.etcd import (
    ROUTERS,
    WORKERS,
    EtcdUnavailable,
    LeasedKey,
    open_client,
    parse_endpoint,
    router_key,
    worker_key,
)
from sluice_inference.common.etcd_watch import watch_prefix_snapshots
from sluice_inference.common.local_cluster import free_port
from sluice_inference.common.trust_settings import EtcdSettings
from tests.support.etcd_server import EtcdServer

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]

Snapshot = dict[str, bytes]


# ---------------------------------------------------------------- helpers


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Poll `condition` every 20 ms until true; returns the seconds it took, fails after `timeout_s`."""
    start = time.monotonic()
    while True:
        if await condition():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


async def read_key(settings: EtcdSettings, key: str) -> bytes | None:
    """The key's value through a fresh client (so etcd restarts do not matter); None if absent."""
    client = await open_client(settings)
    try:
        result = await client.get(key.encode())
        return None if result is None else bytes(result.value)
    finally:
        await client.close()


async def key_lease(settings: EtcdSettings, key: str) -> int | None:
    """ID of the lease the key is bound to; None if the key is absent."""
    client = await open_client(settings)
    try:
        result = await client.get(key.encode())
        return None if result is None else int(result.lease)
    finally:
        await client.close()


async def put_key(settings: EtcdSettings, key: str, value: bytes, lease_ttl_s: int | None = None) -> None:
    """Write a key directly, optionally under a fresh lease that nobody refreshes."""
    client = await open_client(settings)
    try:
        lease = None if lease_ttl_s is None else await client.lease(lease_ttl_s)
        await client.put(key.encode(), value, lease=lease)
    finally:
        await client.close()


async def delete_key(settings: EtcdSettings, key: str) -> None:
    """Delete a key directly."""
    client = await open_client(settings)
    try:
        await client.delete(key.encode())
    finally:
        await client.close()


def other_tasks() -> set[asyncio.Task[object]]:
    """Tasks of this loop other than the test's own: must be empty once everything is closed."""
    return {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}


async def assert_no_leaked_tasks() -> None:
    """Allow a moment for cancelled tasks to finish, then insist none is left."""
    await wait_until(_no_other_tasks, 1.0, "every background task finished")


async def _no_other_tasks() -> bool:
    return not other_tasks()


class SnapshotRecorder:
    """Runs `watch_prefix_snapshots` in a task and keeps everything it yields."""

    def __init__(self, settings: EtcdSettings, prefix: str) -> None:
        self._settings = settings
        self._prefix = prefix
        self.snapshots: list[Snapshot] = []

    async def run(self) -> None:
        """Consume the generator until cancelled."""
        async for snapshot in watch_prefix_snapshots(self._settings, self._prefix):
            self.snapshots.append(snapshot)

    async def wait_for(self, condition: Callable[[Snapshot], bool], timeout_s: float, what: str) -> float:
        """Wait until the latest snapshot satisfies `condition`; returns the seconds it took."""

        async def latest_matches() -> bool:
            return bool(self.snapshots) and condition(self.snapshots[-1])

        return await wait_until(latest_matches, timeout_s, f"{what} (last: {self.snapshots[-1:]})")


@asynccontextmanager
async def recording(settings: EtcdSettings, prefix: str) -> AsyncIterator[SnapshotRecorder]:
    """A running SnapshotRecorder; cancelled (and checked for leftovers) on exit."""
    recorder = SnapshotRecorder(settings, prefix)
    task = asyncio.create_task(recorder.run())
    try:
        yield recorder
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled(), f"the watch ended by itself: {task!r}"


# ---------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("etcd.local:1", ("etcd.local", 1)),
        ("[::1]:2379", ("::1", 2379)),
    ],
)
def test_parse_endpoint_accepts_host_port(endpoint: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint) == expected


@pytest.mark.parametrize(
    "endpoint", ["127.0.0.1", ":2379", "host:", "host:x", "host:70000", "http://h:2379", "::1:2"]
)
def test_parse_endpoint_rejects_malformed(endpoint: str) -> None:
    with pytest.raises(ValueError, match="etcd endpoint"):
        parse_endpoint(endpoint)


def test_key_layout() -> None:
    assert worker_key("/sluice/", "w1") == "/sluice/workers/w1"
    assert router_key("/sluice/", "r1") == "/sluice/routers/r1"
    with pytest.raises(ValueError):
        worker_key("/sluice/", "a/b")


# ---------------------------------------------------------------- open_client


async def test_open_client_skips_dead_endpoints(etcd_server: EtcdServer) -> None:
    settings = EtcdSettings(endpoints=[f"127.0.0.1:{free_port()}", etcd_server.endpoint])
    client = await open_client(settings)
    try:
        await client.put(b"/sluice/probe", b"1")
    finally:
        await client.close()


async def test_open_client_raises_when_nothing_answers() -> None:
    settings = EtcdSettings(endpoints=[f"127.0.0.1:{free_port()}"])
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable, match="no etcd endpoint answered"):
        await open_client(settings)
    assert time.monotonic() - started < 3.0


# ---------------------------------------------------------------- LeasedKey


async def test_leased_key_registers_updates_and_revokes(etcd_settings: EtcdSettings) -> None:
    key = worker_key(etcd_settings.prefix, "w1")
    leased = LeasedKey(etcd_settings, key, b'{"state":"ready"}')
    await leased.start()
    assert leased.connected
    assert leased.lease_id is not None
    assert await read_key(etcd_settings, key) == b'{"state":"ready"}'
    assert await key_lease(etcd_settings, key) == leased.lease_id

    lease_before = leased.lease_id
    await leased.update(b'{"state":"draining"}')
    assert await read_key(etcd_settings, key) == b'{"state":"draining"}'
    assert leased.lease_id == lease_before

    started = time.monotonic()
    await leased.revoke()
    assert await read_key(etcd_settings, key) is None
    assert time.monotonic() - started < 0.5
    assert leased.lease_id is None
    assert not leased.connected
    await leased.revoke()  # idempotent
    with pytest.raises(RuntimeError):
        await leased.update(b"late")
    await assert_no_leaked_tasks()


async def test_start_raises_when_etcd_is_unreachable() -> None:
    settings = EtcdSettings(endpoints=[f"127.0.0.1:{free_port()}"], lease_ttl_s=2)
    leased = LeasedKey(settings, worker_key(settings.prefix, "w1"), b"x")
    with pytest.raises(EtcdUnavailable):
        await leased.start()
    assert not leased.connected
    await assert_no_leaked_tasks()


_OWNER_SCRIPT = """
import asyncio, sys
from sluice_inference.common.config import EtcdSettings
from sluice_inference.common.etcd import LeasedKey

async def main() -> None:
    key = LeasedKey(EtcdSettings.model_validate_json(sys.argv[1]), sys.argv[2], b"alive")
    await key.start()
    print("registered", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_key_vanishes_within_ttl_after_owner_is_killed(etcd_settings: EtcdSettings) -> None:
    key = worker_key(etcd_settings.prefix, "doomed")
    owner = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _OWNER_SCRIPT,
        etcd_settings.model_dump_json(),
        key,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert owner.stdout is not None
        line = await asyncio.wait_for(owner.stdout.readline(), 15)
        assert line.strip() == b"registered"
        assert await read_key(etcd_settings, key) == b"alive"
        # Outlive a full TTL first: the owner's keepalive, not the initial grant, is what keeps it.
        await asyncio.sleep(etcd_settings.lease_ttl_s + 0.5)
        assert await read_key(etcd_settings, key) == b"alive"
    finally:
        owner.kill()
        await owner.wait()

    async def gone() -> bool:
        return await read_key(etcd_settings, key) is None

    await wait_until(gone, etcd_settings.lease_ttl_s + 1.0, "the killed owner's key expires")


async def test_revoke_is_bounded_when_etcd_is_down(
    etcd_server: EtcdServer, etcd_settings: EtcdSettings
) -> None:
    leased = LeasedKey(etcd_settings, worker_key(etcd_settings.prefix, "w1"), b"x")
    await leased.start()
    await asyncio.to_thread(etcd_server.stop)
    started = time.monotonic()
    await leased.revoke()
    assert time.monotonic() - started < 4.0
    await assert_no_leaked_tasks()


async def test_key_survives_etcd_restart_after_ttl(
    etcd_server: EtcdServer, etcd_settings: EtcdSettings
) -> None:
    """etcd down for longer than the TTL: the key is there when it returns and stays (kept alive)."""
    key = worker_key(etcd_settings.prefix, "w1")
    leased = LeasedKey(etcd_settings, key, b"ready")
    await leased.start()
    try:
        await asyncio.to_thread(etcd_server.stop)

        async def disconnected() -> bool:
            return not leased.connected

        await wait_until(disconnected, 2.0, "the keepalive notices the outage")
        await asyncio.sleep(etcd_settings.lease_ttl_s + 0.5)
        await asyncio.to_thread(etcd_server.start)

        async def registered() -> bool:
            return leased.connected and await read_key(etcd_settings, key) == b"ready"

        await wait_until(registered, 3.0, "the key is registered again")
        # Kept alive, not merely restored: still there after more than a TTL.
        await asyncio.sleep(etcd_settings.lease_ttl_s + 1.0)
        assert await read_key(etcd_settings, key) == b"ready"
        assert await key_lease(etcd_settings, key) == leased.lease_id
    finally:
        await leased.revoke()
    assert await read_key(etcd_settings, key) is None


async def test_reregisters_when_etcd_returns_without_the_lease(
    etcd_server: EtcdServer, etcd_settings: EtcdSettings
) -> None:
    key = worker_key(etcd_settings.prefix, "w1")
    leased = LeasedKey(etcd_settings, key, b"ready")
    await leased.start()
    try:
        old_lease = leased.lease_id
        await asyncio.to_thread(etcd_server.restart, wipe_data=True)

        async def registered() -> bool:
            return await read_key(etcd_settings, key) == b"ready"

        await wait_until(registered, 3.0, "the key is re-registered after etcd lost its data")
        assert leased.lease_id != old_lease
        assert await key_lease(etcd_settings, key) == leased.lease_id
        assert leased.connected
    finally:
        await leased.revoke()


async def test_reregisters_when_the_lease_is_revoked_elsewhere(etcd_settings: EtcdSettings) -> None:
    key = worker_key(etcd_settings.prefix, "w1")
    leased = LeasedKey(etcd_settings, key, b"ready")
    await leased.start()
    try:
        old_lease = leased.lease_id
        client = await open_client(etcd_settings)
        try:
            await client.revoke_lease(old_lease)
        finally:
            await client.close()

        async def new_lease() -> bool:
            lease = await key_lease(etcd_settings, key)
            return lease is not None and lease != old_lease

        await wait_until(new_lease, 2.0, "the key comes back under a new lease")
        assert await read_key(etcd_settings, key) == b"ready"
    finally:
        await leased.revoke()


async def test_update_while_etcd_is_down_is_written_when_it_returns(
    etcd_server: EtcdServer, etcd_settings: EtcdSettings
) -> None:
    key = worker_key(etcd_settings.prefix, "w1")
    leased = LeasedKey(etcd_settings, key, b"ready")
    await leased.start()
    try:
        await asyncio.to_thread(etcd_server.stop)
        await leased.update(b"draining")  # must not raise
        await asyncio.to_thread(etcd_server.start)

        async def written() -> bool:
            return await read_key(etcd_settings, key) == b"draining"

        await wait_until(written, 3.0, "the value given during the outage reaches etcd")
    finally:
        await leased.revoke()


# ---------------------------------------------------------------- watch_prefix_snapshots


async def test_watch_sees_initial_contents_puts_and_deletes(etcd_settings: EtcdSettings) -> None:
    workers = etcd_settings.prefix + WORKERS
    await put_key(etcd_settings, workers + "a", b"1")
    await put_key(etcd_settings, etcd_settings.prefix + ROUTERS + "r", b"not a worker")
    async with recording(etcd_settings, workers) as recorder:
        await recorder.wait_for(lambda s: s == {"a": b"1"}, 2.0, "the initial snapshot")
        assert recorder.snapshots[0] == {"a": b"1"}

        await put_key(etcd_settings, workers + "b", b"2")
        took = await recorder.wait_for(lambda s: s == {"a": b"1", "b": b"2"}, 1.0, "a put")
        assert took < 1.0
        await put_key(etcd_settings, workers + "a", b"1'")
        await recorder.wait_for(lambda s: s == {"a": b"1'", "b": b"2"}, 1.0, "an overwrite")
        await delete_key(etcd_settings, workers + "b")
        await recorder.wait_for(lambda s: s == {"a": b"1'"}, 1.0, "a delete")
    await assert_no_leaked_tasks()


async def test_watch_sees_lease_expiry(etcd_settings: EtcdSettings) -> None:
    workers = etcd_settings.prefix + WORKERS
    async with recording(etcd_settings, workers) as recorder:
        await recorder.wait_for(lambda s: s == {}, 2.0, "the empty initial snapshot")
        await put_key(etcd_settings, workers + "frozen", b"x", lease_ttl_s=etcd_settings.lease_ttl_s)
        await recorder.wait_for(lambda s: "frozen" in s, 1.0, "the put")
        await recorder.wait_for(lambda s: s == {}, etcd_settings.lease_ttl_s + 1.5, "the lease-expiry delete")


async def test_watch_survives_etcd_restart(etcd_server: EtcdServer, etcd_settings: EtcdSettings) -> None:
    workers = etcd_settings.prefix + WORKERS
    await put_key(etcd_settings, workers + "a", b"1")
    async with recording(etcd_settings, workers) as recorder:
        await recorder.wait_for(lambda s: s == {"a": b"1"}, 2.0, "the initial snapshot")
        await asyncio.to_thread(etcd_server.stop)
        await asyncio.sleep(0.5)  # the watch breaks and retries while etcd is away
        count = len(recorder.snapshots)
        await asyncio.to_thread(etcd_server.start)
        await put_key(etcd_settings, workers + "b", b"2")
        await recorder.wait_for(lambda s: s == {"a": b"1", "b": b"2"}, 3.0, "a put after the restart")
        assert all(s in ({"a": b"1"}, {"a": b"1", "b": b"2"}) for s in recorder.snapshots[count:])

        # etcd comes back empty: the re-read replaces the view, then new events still arrive.
        await asyncio.to_thread(etcd_server.restart, wipe_data=True)
        await recorder.wait_for(lambda s: s == {}, 3.0, "the view of an etcd that lost its data")
        await put_key(etcd_settings, workers + "c", b"3")
        await recorder.wait_for(lambda s: s == {"c": b"3"}, 3.0, "a put after the wiped restart")
    await assert_no_leaked_tasks()


async def test_watch_waits_for_etcd_and_closes_cleanly(
    etcd_server: EtcdServer, etcd_settings: EtcdSettings
) -> None:
    """Started while etcd is down, it yields once etcd answers; aclose() ends it without leftovers."""
    await asyncio.to_thread(etcd_server.stop)
    snapshots = watch_prefix_snapshots(etcd_settings, etcd_settings.prefix + WORKERS)
    first = asyncio.ensure_future(anext(snapshots))
    await asyncio.sleep(0.5)
    assert not first.done()
    await asyncio.to_thread(etcd_server.start)
    assert await asyncio.wait_for(first, 5.0) == {}
    await snapshots.aclose()
    await assert_no_leaked_tasks()


async def test_watch_rejects_a_prefix_outside_the_registry(etcd_settings: EtcdSettings) -> None:
    with pytest.raises(ValueError, match="outside the registry prefix"):
        await anext(watch_prefix_snapshots(etcd_settings, WORKERS))
