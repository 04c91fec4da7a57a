"""The /metrics endpoint is reachable by anyone who reaches its port: idle connections cannot pin threads
for ever, nor more than a few at once, and it binds where the process's gRPC listener binds."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from sluice_inference.common.metrics import MetricsEndpoint, listen_host

pytestmark = pytest.mark.integration

READ_TIMEOUT_S = 0.5


@pytest.fixture
def endpoint() -> Iterator[MetricsEndpoint]:
    registry = CollectorRegistry()
    Counter("probe", "a sample", registry=registry).inc()
    served = MetricsEndpoint(registry, 0, "127.0.0.1", max_connections=4, read_timeout_s=READ_TIMEOUT_S)
    yield served
    served.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def test_idle_connections_hold_at_most_the_bound_of_threads_and_are_closed_after_the_timeout(
    endpoint: MetricsEndpoint,
) -> None:
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", endpoint.port)) for _ in range(30)]
    try:
        time.sleep(0.2)
        assert threading.active_count() - before <= 4  # was one thread per idle socket
        for conn in idle:
            conn.settimeout(READ_TIMEOUT_S * 6)
            assert conn.recv(1) == b""  # closed by the server: at once past the bound, else at the timeout
        deadline = time.monotonic() + 5
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() == before
        assert "probe_total 1.0" in scrape(endpoint.port)  # and it serves again
    finally:
        for conn in idle:
            conn.close()


def test_the_endpoint_binds_the_listeners_host_only() -> None:
    served = MetricsEndpoint(CollectorRegistry(), 0, listen_host("127.0.0.1:0"))
    try:
        assert served.host == "127.0.0.1"
    finally:
        served.close()
    assert listen_host("0.0.0.0:8001") == "0.0.0.0"
    assert listen_host("[::1]:9000") == "::1"
    assert listen_host("localhost:8001") == "localhost"
