"""How much cyclic garbage a stretch of code leaves: objects that only the cyclic collector can free (a
reference cycle), which every refusal once left behind in the router (docs/performance.md)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


class Garbage:
    """What `cyclic_garbage` found once its block ended."""

    found = -1
    """Unreachable objects the collection after the block found (-1 until the block has ended)."""


@contextmanager
def cyclic_garbage() -> Iterator[Garbage]:
    """Count the unreachable objects the block leaves: collect first (what was garbage before is not the
    block's), keep the collector off while it runs, collect once after it. The collector is on again
    afterwards, whatever happens in the block."""
    seen = Garbage()
    gc.collect()
    gc.disable()
    try:
        yield seen
        seen.found = gc.collect()
    finally:
        gc.enable()
