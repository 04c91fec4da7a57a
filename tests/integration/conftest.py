"""Fixtures shared by integration tests: a real etcd per test and settings that point at it.

Each test gets its own etcd (≈ 0.1-0.5 s to start) so a test that stops, kills or wipes it cannot
disturb another, plus a unique key prefix so leftovers could never be mistaken for a test's own keys.
Teardown stops etcd and removes its folder: no process outlives the test.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from common.config import EtcdSettings
from tests.support.etcd_server import EtcdServer

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
