"""What both gRPC servers (router and worker) share: how they take their address, and the keepalive policy
they enforce on their callers.

An address a server cannot listen on (in use, or not one of this host's) is a `BindError` naming the
server and the address, which the CLI prints as one line: gRPC itself raises a bare RuntimeError that only
points at GRPC_VERBOSITY, and a port in use ended `sluice router` with a traceback.

Callers may ping while idle (routers keep their worker streams alive with 500 ms pings, so a frozen worker
is found fast), but not faster than the server's minimum interval: a caller that does gets `MAX_PING_STRIKES`
strikes, then GOAWAY (ENHANCE_YOUR_CALM, "too_many_pings"). With strikes unlimited (0) a ping flood was
answered for ever, each ping costing the server a frame and a wake-up.
"""

from __future__ import annotations

import grpc

MAX_PING_STRIKES = 2
"""gRPC's own default: bad pings tolerated before GOAWAY (a data frame resets the count)."""


def keepalive_options(min_ping_interval_ms: int) -> list[tuple[str, int]]:
    """Server options: pings allowed while idle, at most one per `min_ping_interval_ms`."""
    return [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


class BindError(OSError):
    """A server could not listen on its configured address."""


def listen(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None, *, what: str
) -> int:
    """Have `server` (not started yet) listen on `address`, with TLS when `credentials` are given; the
    port bound. BindError when it cannot."""
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise BindError(
            f"the {what} cannot listen on {address}: the address is in use or not one of this host's"
        ) from exc
