"""The garbage collector in a long-running server process (router, worker): start-up objects frozen, young
collections less often.

Python's cyclic collector looks at every tracked object the process holds whenever its oldest generation
is collected. A router holds ~80,000 objects after start-up (gRPC, protobuf descriptors, OpenTelemetry,
pydantic, its own modules) and a worker ~200,000 (torch), none of which ever becomes garbage. Measured on
one core at 600-1,000 req/s (docs/performance.md, "The sitting of 2026-12-02"): a full collection paused the
router for 20-31 ms (the worker's, rarer, ~35 ms), long enough to push a batch past a 50 ms SLO, and the
collector took ~16 µs of router CPU per request in all; ~6 µs with the settings below, and no pause over
~4 ms.

So once a process has started (models loaded, ports open) it collects once and freezes what it holds
(`gc.freeze`: those objects move to a permanent generation the collector no longer scans), and collects
its youngest generation every `YOUNG_THRESHOLD` allocations instead of 700. Each served call still leaves
a few reference cycles behind (grpc.aio's call state and servicer context point at each other once a
done-callback is added, and its interceptor continuation is a closure over the call's details): those are
what the young collections find, and a larger threshold finds them with fewer passes over the calls still
in flight. Objects created later (a model version loaded at run time) are collected as usual.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Allocations between young-generation collections (CPython's default is 700): a few hundred calls'
worth, a few megabytes of cyclic garbage at most between passes."""


def settle_after_startup() -> None:
    """Collect what start-up left behind, freeze the rest, and space young collections out. Called once by
    a server process's entry point after it has started; never by library code a test process imports,
    whose heap it would freeze."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
