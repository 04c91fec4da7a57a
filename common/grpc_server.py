"""The keepalive policy both gRPC servers (router and worker) enforce on their callers.

Callers may ping while idle (routers keep their worker streams alive with 500 ms pings, so a frozen worker
is found fast), but not faster than the server's minimum interval: a caller that does gets `MAX_PING_STRIKES`
strikes, then GOAWAY (ENHANCE_YOUR_CALM, "too_many_pings"). With strikes unlimited (0) a ping flood was
answered for ever, each ping costing the server a frame and a wake-up.
"""

from __future__ import annotations

MAX_PING_STRIKES = 2
"""gRPC's own default: bad pings tolerated before GOAWAY (a data frame resets the count)."""


def keepalive_options(min_ping_interval_ms: int) -> list[tuple[str, int]]:
    """Server options: pings allowed while idle, at most one per `min_ping_interval_ms`."""
    return [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
