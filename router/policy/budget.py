"""The budget of bytes in flight: request bodies and their expected responses, while they are served.

Queues bound what waits, the cache and idempotency stores bound what is kept; this bounds everything a
router holds for requests it has accepted, wherever they are (decoding, queued, on a worker, being
encoded, and answers until gRPC has written them: router/servicer.py), so many large requests at once
are refused with RESOURCE_EXHAUSTED instead of growing the process past its memory limit
(docs/security.md, "Limits").

Invariant: `used` is the sum of the sizes acquired and not yet released, and never exceeds `limit`.
"""

from __future__ import annotations

from typing import Final

from sluice_inference.common.errors import ResourceExhausted

RETRY_AFTER_S: Final = 0.1
"""Hint for a refused request: in-flight bytes free up as requests finish, typically within a batch."""


class ByteBudget:
    """Bytes held for requests being served, against a limit."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the byte budget must be positive")
        self.limit = limit
        self.used = 0

    def acquire(self, size: int) -> None:
        """Hold `size` bytes, or raise RESOURCE_EXHAUSTED (nothing held) when they would exceed the limit."""
        if self.used + size > self.limit:
            raise ResourceExhausted(
                f"the router holds {self.used} bytes of requests in flight; {size} more would exceed its "
                f"budget of {self.limit}",
                reason="inflight_bytes",
                retry_after_s=RETRY_AFTER_S,
            )
        self.used += size

    def release(self, size: int) -> None:
        """Give back bytes held by `acquire`."""
        self.used = max(0, self.used - size)
