"""Result cache semantics: a byte-bounded LRU with TTL (tier 1) and the self-verifying entry format that
both tiers store.

Invariants:
- `ByteLRU.bytes_used` never exceeds `capacity_bytes` after `put` returns; it counts every entry's key,
  value and a fixed bookkeeping overhead. A value too large to ever fit is refused, not stored.
- `get` never returns an entry at or past its expiry; expired entries are dropped when met.
- Eviction is least-recently-used: `get` and `put` both mark an entry as used.
- An entry blob embeds an HMAC-SHA256 (`router/policy/sealing.py`, under the cluster's `redis.hmac_key`)
  over (its cache key, model, version, result bytes). `decode_entry` checks it, so a value planted by
  anyone without the key, stored under another key (a bug, a copy-paste in redis-cli) or truncated or
  corrupted is rejected (`Rejected.FORGED`, or `Rejected.MALFORMED` when it cannot even be parsed) and the
  caller treats it as a miss. There is no unkeyed form.

Time is the caller's `now` (seconds, any monotonic scale): nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import enum
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from sluice_inference.common.errors import InvalidArgument
from sluice_inference.router.policy.sealing import MAC_LEN, SealKeys

ENTRY_OVERHEAD_BYTES: Final = 128
"""Approximate per-entry cost of the dict slot, the record and the key object, charged against capacity
so many tiny entries cannot exceed the memory bound the operator configured."""

_MAGIC: Final = b"SLC3"
"""Format 3 holds `sluice.v1.StoredResult` under an HMAC (format 2: the same under a plain SHA-256, which
anyone could recompute; format 1 held KServe responses): an entry of another format is rejected, i.e. a
miss, and the next put replaces it."""
_OLD_MAGICS: Final = (b"SLC1", b"SLC2")
_ENTRY_TAG: Final = b"sluice/cache-entry/3"
_HEADER: Final = struct.Struct(">H")


@dataclass
class LruCounters:
    """Monotonic counters for metrics: hits, misses, expirations, capacity evictions, refused puts, purges."""

    hits: int = 0
    misses: int = 0
    expired: int = 0
    evictions: int = 0
    too_large: int = 0
    purged: int = 0


@dataclass
class _Slot:
    value: bytes
    expires_at: float
    tag: str
    size: int


class ByteLRU:
    """An LRU map from key to bytes, bounded by total size in bytes, with a per-entry time to live."""

    def __init__(self, capacity_bytes: int, ttl_s: float) -> None:
        if capacity_bytes < 0 or ttl_s <= 0:
            raise ValueError("capacity_bytes must be >= 0 and ttl_s > 0")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.counters = LruCounters()
        self._slots: OrderedDict[str, _Slot] = OrderedDict()
        self._bytes = 0

    @property
    def bytes_used(self) -> int:
        """Bytes charged for the entries held now (keys, values and overhead)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, key: str, now: float) -> bytes | None:
        """The live value under `key` (marking it recently used), else None."""
        slot = self._slots.get(key)
        if slot is not None and slot.expires_at <= now:
            self._remove(key)
            self.counters.expired += 1
            slot = None
        if slot is None:
            self.counters.misses += 1
            return None
        self._slots.move_to_end(key)
        self.counters.hits += 1
        return slot.value

    def put(self, key: str, value: bytes, now: float, *, tag: str = "", ttl_s: float | None = None) -> bool:
        """Store `value` for `min(ttl_s, self.ttl_s)` seconds, evicting least-recently-used entries to make
        room; False (nothing stored) if it can never fit. `tag` groups entries for `purge`."""
        size = len(key) + len(value) + ENTRY_OVERHEAD_BYTES
        if key in self._slots:
            self._remove(key)
        if size > self.capacity_bytes:
            self.counters.too_large += 1
            return False
        self._drop_expired_front(now)
        while self._bytes + size > self.capacity_bytes:
            oldest = next(iter(self._slots))
            self._remove(oldest)
            self.counters.evictions += 1
        ttl = self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s)
        self._slots[key] = _Slot(value, now + ttl, tag, size)
        self._bytes += size
        return True

    def discard(self, key: str) -> bool:
        """Remove `key` if present; whether it was."""
        if key not in self._slots:
            return False
        self._remove(key)
        return True

    def purge(self, predicate: Callable[[str], bool]) -> int:
        """Remove every entry whose tag satisfies `predicate`; how many were removed."""
        doomed = [key for key, slot in self._slots.items() if predicate(slot.tag)]
        for key in doomed:
            self._remove(key)
        self.counters.purged += len(doomed)
        return len(doomed)

    def _remove(self, key: str) -> None:
        slot = self._slots.pop(key)
        self._bytes -= slot.size

    def _drop_expired_front(self, now: float) -> None:
        # The least recently used entries are the likeliest to have expired; freeing them first means a
        # put evicts live entries only when the expired ones did not make enough room.
        while self._slots:
            key, slot = next(iter(self._slots.items()))
            if slot.expires_at > now:
                return
            self._remove(key)
            self.counters.expired += 1


@dataclass(frozen=True)
class CachedResult:
    """A verified cache entry: the stored result (`router/stored_results.py`; opaque here), and the model
    and version that produced it."""

    result_bytes: bytes
    model: str
    model_version: str


class Rejected(enum.Enum):
    """Why `decode_entry` refused a value."""

    OLD_FORMAT = "old_format"
    """An entry of format 1 or 2 (an older router sharing the Redis): a plain miss, not a forgery."""
    MALFORMED = "malformed"
    """Not an entry at all: truncated or garbage."""
    FORGED = "forged"
    """Well formed, but its MAC does not verify for this key: planted, copied from another key, or
    corrupted."""


def encode_entry(key: str, result_bytes: bytes, model_version: str, *, model: str, keys: SealKeys) -> bytes:
    """The stored value: magic, a MAC binding it to `key`, the model and version (so a purge can find
    copies promoted from Redis), then the result bytes."""
    mac = keys.seal(_ENTRY_TAG, key.encode(), model.encode(), model_version.encode(), result_bytes)
    names = b"".join(_HEADER.pack(len(b)) + b for b in (model.encode(), model_version.encode()))
    return _MAGIC + mac + names + result_bytes


def _split_names(blob: bytes, at: int) -> tuple[str, str, int] | None:
    names: list[str] = []
    for _ in range(2):
        if len(blob) < at + _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(blob, at)
        at += _HEADER.size
        if len(blob) < at + length:
            return None
        try:
            names.append(blob[at : at + length].decode())
        except UnicodeDecodeError:
            return None
        at += length
    return names[0], names[1], at


def decode_entry(key: str, blob: bytes, *, keys: SealKeys) -> CachedResult | Rejected:
    """The entry in `blob` if it is well formed and was sealed for `key` by a holder of `keys`; otherwise
    why not (the caller's miss)."""
    head = len(_MAGIC) + MAC_LEN
    if blob[: len(_MAGIC)] in _OLD_MAGICS:
        return Rejected.OLD_FORMAT
    if len(blob) < head or not blob.startswith(_MAGIC):
        return Rejected.MALFORMED
    split = _split_names(blob, head)
    if split is None:
        return Rejected.FORGED  # the right magic but unparseable names: damaged or made by hand
    model, version, at = split
    result = blob[at:]
    mac = blob[len(_MAGIC) : head]
    if not keys.verify(mac, _ENTRY_TAG, key.encode(), model.encode(), version.encode(), result):
        return Rejected.FORGED
    return CachedResult(result_bytes=result, model=model, model_version=version)


def purge_tag(model: str, version: str | None = None) -> str:
    """The `ByteLRU` tag of entries for (model, version), or the prefix shared by all versions of `model`
    when `version` is None. Length-prefixed, so model "a" never matches model "ab"."""
    head = f"{len(model)}:{model}"
    return head if version is None else f"{head}{version}"


class CacheUse(enum.Enum):
    """What a request does with the result cache."""

    OFF = "off"
    """The model is not cacheable (not deterministic, or its cache is disabled)."""
    BYPASS = "bypass"
    """Cacheable, but the request set parameters["cache"]=false, or the tenant's audits of this model failed
    too often: neither read nor written."""
    LOOKUP = "lookup"
    """Read the cache; on a miss, execute (coalesced) and write the result."""


def cache_use(
    *, deterministic: bool, enabled: bool, requested: object = None, banned: bool = False
) -> CacheUse:
    """Decide from the model's config, the request's `parameters["cache"]` (None when absent) and whether
    the tenant's audits of this model failed too often (`banned`: router/policy/cache_audit.py);
    InvalidArgument unless that parameter is a bool."""
    if requested is not None and not isinstance(requested, bool):
        raise InvalidArgument('parameters["cache"] must be a bool', reason="bad_parameter")
    if not (deterministic and enabled):
        return CacheUse.OFF
    return CacheUse.BYPASS if requested is False or banned else CacheUse.LOOKUP
