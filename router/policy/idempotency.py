"""Idempotency semantics: keys, records, and the decisions every store (in-process or Redis) carries out.

A record lives under `scoped_key(tenant, key)` and is in exactly one of two states:
- IN_FLIGHT: one caller (the owner, named by a random token) is executing the request. It holds a *lease*
  (the request's deadline plus a margin); once the lease ends the record is dead, so an owner that crashed
  blocks its key for at most one lease.
- COMPLETED: the outcome (a result, or a terminal error's code and message) is stored until the record's
  TTL (default 24 h) ends, and replayed to every later caller with the same fingerprint — even after a new
  model version rolled out, because the stored result names the version that produced it.

Decisions (`decide`): no live record → Proceed (become the owner); a live record with another fingerprint →
Conflict (FAILED_PRECONDITION: the key was reused for a different request); same fingerprint → Wait while
in flight, Replay once completed. An owner ends its claim with `settle(code)`: "store" for a success or a
terminal error, "release" for outcomes the caller is expected to retry (the retry then executes afresh).
Only the owner may release (its token must match), so a late owner whose lease already passed cannot free a
newer owner's claim; completion is accepted from any caller with the same fingerprint unless the record is
already completed (first completion wins).

Privacy: scoped keys are SHA-256 digests of (tenant, key), so tenant B's identical key string names a
different record, and a Redis key never shows the raw idempotency key. Records hold the request's
fingerprint (a digest), never its inputs.

Integrity: records written to a shared store are sealed (router/policy/idempotency_records.py).

Pure: no I/O, no clock (every `now` is a parameter), no randomness (stores make tokens).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, Literal

from sluice_inference.common.errors import Code, FailedPrecondition, InvalidArgument, Unavailable

MAX_KEY_LENGTH: Final = 255
DEFAULT_RECORD_TTL_S: Final = 24 * 3600.0
DEFAULT_MAX_RECORDS: Final = 100_000
DEFAULT_MAX_BYTES: Final = 64 * 1024 * 1024
RECORD_OVERHEAD_BYTES: Final = 256
"""Python objects around one in-process record (tuple, dataclass, dict and order entries), roughly."""
DEFAULT_LEASE_MARGIN_S: Final = 2.0
STORE_DOWN_RETRY_S: Final = 1.0
MAX_STORED_MESSAGE: Final = 1024

RELEASE_CODES: Final[frozenset[Code]] = frozenset(
    {
        Code.CANCELLED,  # the caller gave up: from its view the call never completed
        Code.DEADLINE_EXCEEDED,  # likewise; a retry with more time should run, not replay the timeout
        Code.UNAVAILABLE,  # shed, no worker, worker lost: retryable by definition (docs/design.md §5)
        Code.RESOURCE_EXHAUSTED,  # rate limit or quota: retryable after the hint
        Code.ABORTED,  # concurrency conflict: retryable
        Code.UNKNOWN,  # we cannot tell it is terminal, so we must not pin it for a day
    }
)
"""Outcomes that release the key. Everything else — OK and terminal errors (INVALID_ARGUMENT, NOT_FOUND,
INTERNAL, PERMISSION_DENIED, FAILED_PRECONDITION, ...) — is stored and replayed."""

_SCOPE_TAG: Final = b"sluice/idempotency-key/1"


class State(enum.Enum):
    """Where a record stands."""

    IN_FLIGHT = "F"
    COMPLETED = "D"


@dataclass(frozen=True)
class StoredSuccess:
    """A successful outcome: the stored result (`router/stored_results.py`; opaque here) and the model
    version that produced it."""

    result_bytes: bytes
    model_version: str


@dataclass(frozen=True)
class StoredError:
    """A terminal error outcome, replayed as the same status code and message."""

    code: int
    message: str


StoredOutcome = StoredSuccess | StoredError


@dataclass(frozen=True)
class Record:
    """One key's state. `until` ends the lease (IN_FLIGHT) or the TTL (COMPLETED), on the store's time scale;
    records read from Redis carry `math.inf` because Redis enforces their expiry itself."""

    fingerprint: str
    state: State
    owner: str
    outcome: StoredOutcome | None
    until: float


@dataclass(frozen=True)
class Ticket:
    """Proof of a claim: what the owner passes back to complete or release it."""

    scoped_key: str
    fingerprint: str
    token: str
    tenant: str = ""
    """Whose record it is: the in-process table bounds each tenant's share of its bytes."""


@dataclass(frozen=True)
class Proceed:
    """The caller owns the key: execute, then complete or release with `ticket`."""

    ticket: Ticket


@dataclass(frozen=True)
class Wait:
    """Another caller is executing the same request; wait for its outcome until `until` (lease end, or
    `math.inf` when the store does not know it), then claim again."""

    until: float


@dataclass(frozen=True)
class Replay:
    """The request already completed: answer with the stored outcome."""

    outcome: StoredOutcome


@dataclass(frozen=True)
class Conflict:
    """The key is held for a different request."""


ClaimDecision = Proceed | Wait | Replay | Conflict


def validate_key(key: str) -> str:
    """The key if it is 1-255 printable ASCII characters (space to tilde); InvalidArgument otherwise."""
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise InvalidArgument(
            f"idempotency-key must be 1-{MAX_KEY_LENGTH} characters, got {len(key)}",
            reason="bad_idempotency_key",
        )
    if not all(" " <= ch <= "~" for ch in key):
        raise InvalidArgument("idempotency-key must be printable ASCII", reason="bad_idempotency_key")
    return key


def scoped_key(tenant: str, key: str) -> str:
    """Hex SHA-256 of (tenant, key): the record's name. Validates `key`."""
    validate_key(key)
    digest = hashlib.sha256()
    for part in (_SCOPE_TAG, tenant.encode(), key.encode()):
        digest.update(struct.pack(">Q", len(part)))
        digest.update(part)
    return digest.hexdigest()


def lease_seconds(timeout_s: float, margin_s: float = DEFAULT_LEASE_MARGIN_S) -> float:
    """How long an in-flight claim holds: the request's time budget plus a margin for the answer to land."""
    return max(timeout_s, 0.0) + margin_s


def settle(code: int) -> Literal["store", "release"]:
    """What an owner does with its outcome: keep it for replay, or free the key for a retry."""
    return "release" if code in RELEASE_CODES else "store"


def is_live(record: Record, now: float) -> bool:
    """Whether the record still binds its key (lease or TTL not over)."""
    return now < record.until


def decide(existing: Record | None, *, ticket: Ticket, now: float) -> ClaimDecision:
    """The outcome of a claim by `ticket` (fingerprint + a fresh token) against the current record."""
    if existing is None or not is_live(existing, now):
        return Proceed(ticket)
    if existing.fingerprint != ticket.fingerprint:
        return Conflict()
    if existing.state is State.IN_FLIGHT:
        return Wait(existing.until)
    assert existing.outcome is not None, "a completed record always holds its outcome"
    return Replay(existing.outcome)


@dataclass(frozen=True)
class Pending:
    """A waiter's view of a record still in flight for its request, until `until`."""

    until: float


def on_wake(existing: Record | None, fingerprint: str, now: float) -> StoredOutcome | Pending | None:
    """What a waiter learns from the record: the outcome to replay, Pending, or None — released, expired, or
    now held for another request — meaning "claim again" (which then proceeds, waits or conflicts)."""
    if existing is None or not is_live(existing, now) or existing.fingerprint != fingerprint:
        return None
    if existing.state is State.IN_FLIGHT:
        return Pending(existing.until)
    return existing.outcome


def may_complete(existing: Record | None, ticket: Ticket, now: float) -> bool:
    """Whether `ticket` may write its outcome: not over a completed record (first completion wins), nor over
    another request's live record; yes over a dead or missing one (the result is still worth keeping)."""
    if existing is None or not is_live(existing, now):
        return True
    return existing.state is State.IN_FLIGHT and existing.fingerprint == ticket.fingerprint


def may_release(existing: Record | None, ticket: Ticket, now: float) -> bool:
    """Whether `ticket` may free the key: only its own live in-flight claim."""
    return (
        existing is not None
        and is_live(existing, now)
        and existing.state is State.IN_FLIGHT
        and existing.owner == ticket.token
    )


def in_flight(ticket: Ticket, now: float, lease_s: float) -> Record:
    """The record a successful claim writes."""
    return Record(ticket.fingerprint, State.IN_FLIGHT, ticket.token, None, now + lease_s)


def completed(ticket: Ticket, outcome: StoredOutcome, now: float, ttl_s: float) -> Record:
    """The record a completion writes."""
    if isinstance(outcome, StoredError):
        outcome = StoredError(outcome.code, outcome.message[:MAX_STORED_MESSAGE])
    return Record(ticket.fingerprint, State.COMPLETED, ticket.token, outcome, now + ttl_s)


def conflict_error() -> FailedPrecondition:
    """FAILED_PRECONDITION for a key reused with a different request (docs/design.md §5)."""
    return FailedPrecondition(
        "idempotency-key was already used with a different request (model, version, inputs, outputs or "
        "parameters differ); use a new key",
        reason="idempotency_key_reused",
    )


def store_down_error(detail: str, retry_after_s: float = STORE_DOWN_RETRY_S) -> Unavailable:
    """UNAVAILABLE for a keyed request while the idempotency store cannot be reached (fail closed)."""
    return Unavailable(
        f"idempotency store unavailable ({detail}); keyed requests are refused rather than risk running "
        "twice",
        reason="idempotency_store_down",
        retry_after_s=retry_after_s,
    )


@dataclass
class TableCounters:
    """Monotonic counters of the in-process table, for metrics."""

    claims: int = 0
    conflicts: int = 0
    replays: int = 0
    waits: int = 0
    expired: int = 0
    evictions: int = 0


def record_bytes(scoped_key: str, record: Record) -> int:
    """What a record costs in memory: its key, fingerprint, owner and stored outcome, plus bookkeeping."""
    outcome = record.outcome
    payload = 0
    if isinstance(outcome, StoredSuccess):
        payload = len(outcome.result_bytes) + len(outcome.model_version)
    elif isinstance(outcome, StoredError):
        payload = len(outcome.message)
    return RECORD_OVERHEAD_BYTES + len(scoped_key) + len(record.fingerprint) + len(record.owner) + payload


class IdempotencyTable:
    """Records of one process, expired by `until` and bounded in count and in bytes, with per-tenant
    shares. Pure; the in-process store drives it.

    When a write would exceed a bound, the oldest record of the tenant holding the most bytes is evicted
    (counted), again until it fits: a tenant is only ever evicted while no other tenant holds more, so each
    of T active tenants keeps at least `max_bytes / T` — one tenant's stream of large responses cannot push
    out another's records. Evicting a live record forgets a key early, which only loses deduplication for
    it; in-flight records are small and few (bounded by in-flight quotas). A record larger than the whole
    budget is not kept (`complete` returns False), so a later duplicate executes again.
    """

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_records < 1 or max_bytes < 1:
            raise ValueError("max_records and max_bytes must be >= 1")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.counters = TableCounters()
        self.bytes = 0
        self._records: dict[str, tuple[Record, str, int]] = {}
        """scoped key → (record, tenant, bytes)"""
        self._order: dict[str, OrderedDict[str, None]] = {}
        """tenant → its scoped keys, oldest write first"""
        self._tenant_bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._records)

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes held by one tenant's records."""
        return self._tenant_bytes.get(tenant, 0)

    def lookup(self, scoped_key: str, now: float) -> Record | None:
        """The live record under `scoped_key`, dropping it if dead."""
        entry = self._records.get(scoped_key)
        if entry is None:
            return None
        if not is_live(entry[0], now):
            self._drop(scoped_key)
            self.counters.expired += 1
            return None
        return entry[0]

    def claim(self, ticket: Ticket, now: float, lease_s: float) -> ClaimDecision:
        """Decide, and on Proceed write the in-flight record."""
        decision = decide(self.lookup(ticket.scoped_key, now), ticket=ticket, now=now)
        if isinstance(decision, Proceed):
            self._write(ticket, in_flight(ticket, now, lease_s), now)
            self.counters.claims += 1
        elif isinstance(decision, Conflict):
            self.counters.conflicts += 1
        elif isinstance(decision, Replay):
            self.counters.replays += 1
        else:
            self.counters.waits += 1
        return decision

    def complete(self, ticket: Ticket, outcome: StoredOutcome, now: float, ttl_s: float) -> bool:
        """Store the outcome if `may_complete` and it fits the byte budget; whether it was stored."""
        if not may_complete(self.lookup(ticket.scoped_key, now), ticket, now):
            return False
        return self._write(ticket, completed(ticket, outcome, now, ttl_s), now)

    def release(self, ticket: Ticket, now: float) -> bool:
        """Delete the owner's in-flight record if `may_release`; whether it was deleted."""
        if not may_release(self.lookup(ticket.scoped_key, now), ticket, now):
            return False
        self._drop(ticket.scoped_key)
        return True

    def _write(self, ticket: Ticket, record: Record, now: float) -> bool:
        key, tenant = ticket.scoped_key, ticket.tenant
        size = record_bytes(key, record)
        if key in self._records:
            self._drop(key)
        if size > self.max_bytes:
            return False
        self._drop_dead_front(tenant, now)
        while self._records and (
            len(self._records) >= self.max_records or self.bytes + size > self.max_bytes
        ):
            self._evict_from_heaviest()
        self._records[key] = (record, tenant, size)
        self._order.setdefault(tenant, OrderedDict())[key] = None
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
        self.bytes += size
        return True

    def _evict_from_heaviest(self) -> None:
        heaviest = max(self._tenant_bytes, key=lambda name: (self._tenant_bytes[name], name))
        oldest = next(iter(self._order[heaviest]))
        self._drop(oldest)
        self.counters.evictions += 1

    def _drop(self, scoped_key: str) -> None:
        _, tenant, size = self._records.pop(scoped_key)
        order = self._order[tenant]
        del order[scoped_key]
        self._tenant_bytes[tenant] -= size
        self.bytes -= size
        if not order:
            del self._order[tenant], self._tenant_bytes[tenant]

    def _drop_dead_front(self, tenant: str, now: float) -> None:
        """Drop the tenant's expired records from the front of its write order (records share one TTL)."""
        order = self._order.get(tenant)
        while order:
            key = next(iter(order))
            if is_live(self._records[key][0], now):
                return
            self._drop(key)
            self.counters.expired += 1
            order = self._order.get(tenant)
