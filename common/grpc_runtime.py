"""How gRPC's C core does its socket I/O in Sluice's processes: on the thread that polls its completion
queue (iomgr), not on a separate EventEngine thread pool.

grpcio 1.85 by default runs listeners, client connections and endpoints on EventEngine, whose own threads
read and write the sockets and hand every completion over to the thread grpc.aio polls with. On one core
shared by a router, a worker and etcd that hand-over is paid on every message: measured on this project's
2-core machine (docs/performance.md, "The sitting of 2026-12-02"), a bare grpc.aio server spent
8-10 % less CPU per unary call (`bench/grpc_floor.py --mode aio-gated`) and each end of a bidi stream
~17 % less per message pair (`bench/stream_floor.py`) with EventEngine's listener and client turned off,
which is what `GRPC_EXPERIMENTS` below does. The C core reads the variable once, when the `grpc` module is
first imported: so it is set by the `sluice` command's package before anything imports grpc, and only as a
default — an operator's own `GRPC_EXPERIMENTS` (even an empty one, which restores gRPC's defaults) wins.
"""

from __future__ import annotations

import os

IO_ON_POLLING_THREAD = "-event_engine_listener,-event_engine_client"
"""gRPC experiments turned off: EventEngine listeners and clients (iomgr's TCP server and client then)."""


def prefer_polling_thread_io() -> bool:
    """Make `IO_ON_POLLING_THREAD` this process's gRPC experiments unless the environment names its own;
    True when it did. Takes effect only before `grpc` is first imported (and is inherited by children)."""
    if "GRPC_EXPERIMENTS" in os.environ:
        return False
    os.environ["GRPC_EXPERIMENTS"] = IO_ON_POLLING_THREAD
    return True
