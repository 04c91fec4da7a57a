"""The byte format of an idempotency record in a shared store (router/policy/idempotency.py holds the
semantics): what a router writes to Redis and how another router reads it back.

A record is sealed (`encode_record`: an HMAC-SHA256 under the cluster's `redis.hmac_key` over its scoped
key and contents, router/policy/sealing.py); `decode_record` refuses anything else with `RecordRejected`,
so a planted, copied or corrupted record is never replayed (the store treats it as absent), and one of an
older router's format is told apart (`old_format`). Times are not stored: the store's own expiry enforces
a record's `until`.
"""

from __future__ import annotations

import math
import struct
from typing import Final

from sluice_inference.router.policy.idempotency import (
    MAX_STORED_MESSAGE,
    Record,
    State,
    StoredError,
    StoredOutcome,
    StoredSuccess,
)
from sluice_inference.router.policy.sealing import MAC_LEN, SealKeys

_RECORD_MAGIC: Final = b"SLI3"
"""Format 3 is format 2 (successes as `sluice.v1.StoredResult`) sealed with an HMAC; format 1 held KServe
responses. A record of another format does not decode, so no router ever replays bytes it would misread
or that it cannot prove a router wrote."""
_OLD_MAGICS: Final = (b"SLI1", b"SLI2")
_RECORD_TAG: Final = b"sluice/idempotency-record/3"
_U16: Final = struct.Struct(">H")


def _lp(data: bytes) -> bytes:
    return _U16.pack(len(data)) + data


def _encode_outcome(outcome: StoredOutcome | None) -> bytes:
    if outcome is None:
        return b"-"
    if isinstance(outcome, StoredSuccess):
        return b"R" + _lp(outcome.model_version.encode()) + outcome.result_bytes
    return b"E" + _U16.pack(outcome.code) + outcome.message.encode()[: MAX_STORED_MESSAGE * 4]


class RecordRejected(ValueError):
    """A stored value that is not a record sealed for its key by a holder of the cluster's keys."""

    def __init__(self, message: str, *, old_format: bool = False) -> None:
        super().__init__(message)
        self.old_format = old_format
        """A record of an older router's format (unsealed): unreadable, but no sign of tampering."""


def encode_record(record: Record, *, scoped_key: str, keys: SealKeys) -> bytes:
    """Bytes for a shared store, sealed for `scoped_key` (no times: the store's own expiry enforces
    `until`)."""
    body = (
        record.state.value.encode()
        + _lp(record.fingerprint.encode())
        + _lp(record.owner.encode())
        + _encode_outcome(record.outcome)
    )
    return _RECORD_MAGIC + keys.seal(_RECORD_TAG, scoped_key.encode(), body) + body


class _Reader:
    def __init__(self, blob: bytes) -> None:
        self.blob, self.at = blob, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.blob):
            raise ValueError("truncated record")
        part = self.blob[self.at : self.at + n]
        self.at += n
        return part

    def u16(self) -> int:
        return int(_U16.unpack(self.take(_U16.size))[0])

    def prefixed(self) -> bytes:
        return self.take(self.u16())

    def rest(self) -> bytes:
        part, self.at = self.blob[self.at :], len(self.blob)
        return part


def _decode_outcome(reader: _Reader) -> StoredOutcome | None:
    kind = reader.take(1)
    if kind == b"-":
        return None
    if kind == b"R":
        version = reader.prefixed().decode()
        return StoredSuccess(result_bytes=reader.rest(), model_version=version)
    if kind == b"E":
        code = reader.u16()
        return StoredError(code=code, message=reader.rest().decode(errors="replace"))
    raise ValueError(f"unknown outcome kind {kind!r}")


def decode_record(blob: bytes, *, scoped_key: str, keys: SealKeys) -> Record:
    """Parse `encode_record` output stored under `scoped_key` (`until` = inf); RecordRejected unless it
    is a well-formed record of this format sealed for that key by one of `keys`."""
    magic = blob[: len(_RECORD_MAGIC)]
    if magic in _OLD_MAGICS:
        raise RecordRejected(f"a record of format {magic.decode()}", old_format=True)
    head = len(_RECORD_MAGIC) + MAC_LEN
    if magic != _RECORD_MAGIC or len(blob) < head:
        raise RecordRejected("not an idempotency record")
    body = blob[head:]
    if not keys.verify(blob[len(_RECORD_MAGIC) : head], _RECORD_TAG, scoped_key.encode(), body):
        raise RecordRejected("the record's seal does not verify")
    try:
        return _parse_body(body)
    except (ValueError, UnicodeDecodeError) as exc:  # sealed yet malformed: a writer's bug
        raise RecordRejected(f"malformed record ({exc})") from exc


def _parse_body(body: bytes) -> Record:
    reader = _Reader(body)
    state = State(reader.take(1).decode())
    fingerprint = reader.prefixed().decode()
    owner = reader.prefixed().decode()
    outcome = _decode_outcome(reader)
    if (state is State.COMPLETED) != (outcome is not None):
        raise ValueError("a record holds an outcome iff it is completed")
    return Record(fingerprint, state, owner, outcome, math.inf)
