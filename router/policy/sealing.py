"""Sealed values: what a router writes to a shared store (Redis) carries an HMAC-SHA256 that only holders
of the cluster's key can make, so a value planted, copied to another key or corrupted by anyone else is
recognised on read and treated as absent (docs/security.md, "Redis").

Rules:
- The MAC covers a domain tag (which kind of value, which format) and every part, each length-prefixed,
  so no two different (tag, parts) sequences share an input, and a cache entry can never pass as an
  idempotency record or the other way round.
- Writing uses the first key; reading accepts any key of the list (the old one during a rotation).
- Verification compares in constant time.

Pure: no I/O, no randomness (a shell that needs a throw-away key makes it).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import Final

MAC_LEN: Final = 32
"""Bytes of an HMAC-SHA256."""


class SealKeys:
    """The keys a store seals with (the first) and accepts (all of them)."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys or not all(keys):
            raise ValueError("sealing needs at least one non-empty key")
        self._keys = tuple(bytes(k) for k in keys)

    def __repr__(self) -> str:
        return f"SealKeys(<{len(self._keys)} keys>)"

    def seal(self, tag: bytes, *parts: bytes) -> bytes:
        """The MAC of (tag, parts) under the writing key."""
        return _mac(self._keys[0], tag, parts)

    def verify(self, mac: bytes, tag: bytes, *parts: bytes) -> bool:
        """Whether `mac` was made over (tag, parts) by one of the accepted keys."""
        return any(hmac.compare_digest(mac, _mac(key, tag, parts)) for key in self._keys)


def _mac(key: bytes, tag: bytes, parts: tuple[bytes, ...]) -> bytes:
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for part in (tag, *parts):
        digest.update(struct.pack(">Q", len(part)))
        digest.update(part)
    return digest.digest()
