"""Prometheus plumbing shared by router and worker: bucket layouts and the /metrics HTTP endpoint.

Each process builds its metrics on its own CollectorRegistry (not the global default), so several routers
or workers can live in one test process without colliding.

The endpoint is reachable by anyone who can reach the port (docs/security.md), so it is bounded: at most
`MAX_CONNECTIONS` connections at once (more are closed at once, unread), each must send its request within
`READ_TIMEOUT_S`, and it binds the host of the process's own gRPC listener. prometheus_client's own server
held a thread per idle connection for as long as the client kept it open (30 idle sockets: 30 threads).
"""

from __future__ import annotations

import socket
import sys
import threading
from socketserver import ThreadingMixIn
from typing import Any, Generic, Protocol, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

# Seconds; inference latency lives between ~100 µs and a few seconds.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

MAX_CHILDREN = 4096
"""Children one `Bound` keeps; past it, it starts over (label values are bounded sets anyway)."""
MAX_CONNECTIONS = 8
"""Scrapes served at once; Prometheus opens one per target (a few for HA pairs)."""
READ_TIMEOUT_S = 5.0
"""How long a connection may take to send its request, and to read the answer."""


Child_co = TypeVar("Child_co", covariant=True)


class Labelled(Protocol[Child_co]):
    """A labelled metric: prometheus_client's, or common/loop_metrics.py's."""

    def labels(self, *values: str) -> Child_co:
        """The child for these label values."""
        ...


Child = TypeVar("Child")


class Bound(Generic[Child]):
    """A labelled metric's children, each bound once per label values: `metric.labels(...)` takes a lock
    and builds its key on every call (4 µs here, on the request path several times per request); a dict
    hit on the values costs a tenth of that. Callers pass only values from bounded sets (the metric's own
    rule); `max_children` bounds the memory regardless."""

    def __init__(self, metric: Labelled[Child], max_children: int = MAX_CHILDREN) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Child] = {}
        self._max = max_children

    def __call__(self, *values: str) -> Child:
        """The child for these label values."""
        child = self._children.get(values)
        if child is None:
            if len(self._children) >= self._max:
                self._children.clear()
            child = self._children[values] = self._metric.labels(*values)
        return child


def listen_host(listen: str) -> str:
    """The host part of a gRPC listen address (`0.0.0.0:8001` → `0.0.0.0`, `[::1]:0` → `::1`), where the
    metrics endpoint binds too."""
    host = listen.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, with the server's socket timeout; no access log."""

    server: _BoundedServer

    def setup(self) -> None:
        """Apply the read timeout before the request is read."""
        super().setup()
        self.connection.settimeout(self.server.read_timeout_s)

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing: scrapes are not events."""


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `max_connections` of them (`limit` sets the bounds)."""

    daemon_threads = True
    read_timeout_s = READ_TIMEOUT_S
    _slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def limit(self, max_connections: int, read_timeout_s: float) -> None:
        """Set this server's bounds (before it serves)."""
        self._slots = threading.BoundedSemaphore(max_connections)
        self.read_timeout_s = read_timeout_s

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread of its own, or close it at once when every slot is taken."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve, then give the slot back."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or hung up is not worth a traceback on stderr (the base class prints
        one per connection, which an idle-connection flood would turn into a log flood)."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _BoundedServer6(_BoundedServer):
    address_family = socket.AF_INET6


class MetricsEndpoint:
    """A /metrics HTTP server on its own thread; `port` is the bound port (useful when asked for 0)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        host: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        server_class = _BoundedServer6 if ":" in host else _BoundedServer
        self._server = make_server(
            host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler
        )
        self._server.limit(max_connections, read_timeout_s)
        self.host: str = str(self._server.server_address[0])
        """The address bound (the listener's host, never wider)."""
        self.port: int = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and join the thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
