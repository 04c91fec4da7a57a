"""Fixtures shared by integration tests: a real etcd per test and settings that point at it.

Each test gets its own etcd (≈ 0.1-0.5 s to start) so a test that stops, kills or wipes it cannot
disturb another, plus a unique key prefix so leftovers could never be mistaken for a test's own keys.
Teardown stops etcd and removes its folder: no process outlives the test.
"""

from __future__ import annotations

import gc
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.heap import frozen_heap
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.common.trust_settings import ClusterSettings, EtcdSettings
from sluice_inference.router.main import RouterServer
from tests.support.etcd_server import EtcdServer
from tests.support.processes import WorkerProcess
from tests.support.redis_server import RedisServer, redis_server_fixture

TEST_LEASE_TTL_S = 2
"""Short leases keep expiry tests quick (the keepalive then runs every ~0.67 s)."""


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A started etcd on free loopback ports; stopped and removed after the test."""
    server = EtcdServer()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def etcd_settings(etcd_server: EtcdServer) -> EtcdSettings:
    """Registry settings for `etcd_server`, with a prefix unique to this test and a 2 s lease TTL."""
    return EtcdSettings(
        endpoints=[etcd_server.endpoint],
        prefix=f"/sluice-test-{uuid.uuid4().hex[:12]}/",
        lease_ttl_s=TEST_LEASE_TTL_S,
    )


@pytest.fixture
def cluster_token() -> str:
    """The router ↔ worker token of this test's cluster: workers refuse to start without a credential."""
    return secrets.token_urlsafe(24)


@pytest.fixture
def cluster_settings(cluster_token: str) -> ClusterSettings:
    """The `cluster` section routers of this test use (the token its workers accept)."""
    return ClusterSettings(token=SecretStr(cluster_token))


def accepting_workers(router: RouterServer) -> list[str]:
    """Workers the router's core sends batches to now."""
    return sorted(w.worker_id for w in router.driver.core.workers if w.accepting)


Spawn = Callable[..., WorkerProcess]
MakeRouter = Callable[..., Awaitable[RouterServer]]


@pytest.fixture
def spawn(
    demo_repo: Path, etcd_settings: EtcdSettings, cluster_token: str, tmp_path: Path
) -> Iterator[Spawn]:
    """Start `sluice worker` processes (the demo `synthetic` model unless told otherwise) that accept the
    test's cluster token (`env`: more SLUICE_* settings); all are killed at teardown."""
    started: list[WorkerProcess] = []

    def start(
        worker_id: str,
        models: str = "synthetic",
        repository: Path | None = None,
        slowdown: float = 1.0,
        env: dict[str, str] | None = None,
    ) -> WorkerProcess:
        env = {
            **(env or {}),
            "SLUICE_WORKER__SYNTHETIC_SLOWDOWN": str(slowdown),
            "SLUICE_CLUSTER__TOKEN": cluster_token,
        }
        worker = WorkerProcess(
            worker_id, repository or demo_repo, etcd_settings, tmp_path, models=models, env=env
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
async def make_router(
    etcd_settings: EtcdSettings, cluster_settings: ClusterSettings
) -> AsyncIterator[MakeRouter]:
    """Start in-process routers on free ports following the test's etcd, holding its cluster token (extra
    config sections as keyword arguments, e.g. tenants=..., admission=...), the front door off unless the
    router section sets it; all are stopped at teardown.

    While they run, the test process's heap as it stood is frozen, as a router process freezes its own
    after start-up (common/heap.py): an in-process router shares the collector with everything the
    session built before it, and halfway through the suite (~760,000 objects) a full collection paused
    it for 250-470 ms. One such pause inside a measured run made test_head_of_line's short p99 368 ms
    against 12-15 ms in its other runs. Freezing moves no memory and is undone at teardown, so what the
    session left behind is collected later, outside the router's runs."""
    started: list[RouterServer] = []

    async def make(**sections: Any) -> RouterServer:
        router = sections.setdefault("router", RouterSettings(listen="127.0.0.1:0", metrics_port=0))
        if "door_max_delay_ms" not in router.model_fields_set:
            # An in-process router shares its event loop with the test's own load generator, whose lag is
            # not the router's overload: the front door is tested where it is the subject (test_front_door).
            sections["router"] = router.model_copy(update={"door_max_delay_ms": 0.0})
        sections.setdefault("cluster", cluster_settings)
        server = RouterServer(SluiceConfig(etcd=etcd_settings, **sections))
        await server.start()
        started.append(server)
        gc.freeze()  # its own start-up objects too, as `settle_after_startup` does
        return server

    with frozen_heap():
        yield make
        for server in started:
            await server.stop(grace=0.5)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real Valkey (Redis-compatible) server on a free loopback port; stopped at teardown."""
    yield from redis_server_fixture()
