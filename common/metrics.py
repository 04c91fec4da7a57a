"""Prometheus plumbing shared by router and worker: bucket layouts and the /metrics HTTP endpoint.

Each process builds its metrics on its own CollectorRegistry (not the global default), so several routers
or workers can live in one test process without colliding.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

# Seconds; inference latency lives between ~100 µs and a few seconds.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class MetricsEndpoint:
    """A /metrics HTTP server on its own thread; `port` is the bound port (useful when asked for 0)."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> None:
        self._server: WSGIServer
        self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        self.port: int = self._server.server_port

    def close(self) -> None:
        """Stop serving and join the thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
