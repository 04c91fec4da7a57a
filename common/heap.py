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

A process that is not a server but runs a long stretch of work beside a large heap it built first (the load
generator's run, an in-process router under test beside the test session's heap) freezes that heap for the
stretch only (`frozen_heap`), and gives it back to the collector afterwards. One that allocates much and
leaves little cyclic garbage behind (the simulator's run) spaces its young collections out for the stretch
(`young_collections_every`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

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


class _OpenBlocks:
    """How many `frozen_heap` blocks are open in this process (only the outermost gives the heap back)."""

    count = 0


@contextmanager
def frozen_heap(*, collect: bool = False) -> Iterator[None]:
    """While the block runs, the objects that exist now are out of the collector's view (`gc.freeze`): a
    full collection then scans only what the block creates. `collect` collects first, so what is already
    garbage is not kept frozen (a full collection: a fraction of a second in a large heap). When the
    outermost block ends everything is back in the collector's view, garbage left from before included
    (an inner block, such as a load generator run by a test that already froze the heap, freezes what is
    new and leaves the rest frozen). Not for a server process, whose start-up heap stays frozen for good
    (`settle_after_startup`)."""
    if collect:
        gc.collect()
    gc.freeze()
    _OpenBlocks.count += 1
    try:
        yield
    finally:
        _OpenBlocks.count -= 1
        if not _OpenBlocks.count:
            gc.unfreeze()


@contextmanager
def young_collections_every(allocations: int) -> Iterator[None]:
    """While the block runs, the youngest generation is collected every `allocations` allocations instead
    of the threshold in force (the older generations keep their counts, so they are collected as many young
    passes apart as before); the thresholds in force come back when it ends. Cyclic garbage is still
    collected, only less often: this is for work that leaves almost none, where young passes at CPython's
    700 would only look for garbage that is not there."""
    if allocations < 1:
        raise ValueError(f"allocations must be at least 1, not {allocations}")
    thresholds = gc.get_threshold()
    gc.set_threshold(allocations, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
