"""Idempotency core: key rules, the record state machine, settle rules, the bounded table, and the
in-process store with `acquire` (driven by a fake clock; waits are event-driven, never timed)."""

from __future__ import annotations

import asyncio
import math

import pytest

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.errors import Code, SluiceError
from sluice_inference.router.policy.idempotency import (
    Conflict,
    IdempotencyTable,
    Pending,
    Proceed,
    Record,
    Replay,
    State,
    StoredError,
    StoredSuccess,
    Ticket,
    Wait,
    lease_seconds,
    on_wake,
    scoped_key,
    settle,
    validate_key,
)
from sluice_inference.router.policy.idempotency_records import RecordRejected, decode_record, encode_record
from sluice_inference.router.policy.sealing import SealKeys
from sluice_inference.router.stores.idempotency_store import InProcessIdempotencyStore, acquire

SK = scoped_key("gold", "order-42")
KEYS = SealKeys([b"k" * 32])
OK = StoredSuccess(b"response-bytes", "3")


def ticket(fingerprint: str = "fp-a", token: str = "t1", key: str = SK) -> Ticket:
    return Ticket(scoped_key=key, fingerprint=fingerprint, token=token)


# ---------------------------------------------------------------- keys


@pytest.mark.parametrize("good", ["a", "x" * 255, "order 42/~!", " "])
def test_valid_keys(good: str) -> None:
    assert validate_key(good) == good


@pytest.mark.parametrize("bad", ["", "x" * 256, "tab\there", "é", "new\nline", "\x7f"])
def test_invalid_keys_are_invalid_argument(bad: str) -> None:
    with pytest.raises(SluiceError) as caught:
        validate_key(bad)
    assert caught.value.code == Code.INVALID_ARGUMENT
    assert caught.value.reason == "bad_idempotency_key"


def test_scoped_key_is_a_digest_that_separates_tenants() -> None:
    assert scoped_key("gold", "k") == scoped_key("gold", "k")
    assert scoped_key("gold", "k") != scoped_key("silver", "k")
    assert scoped_key("ab", "c") != scoped_key("a", "bc")
    assert len(SK) == 64 and "order-42" not in SK and "gold" not in SK


# ---------------------------------------------------------------- settle


@pytest.mark.parametrize(
    "code",
    [Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED, Code.CANCELLED, Code.DEADLINE_EXCEEDED, Code.UNKNOWN],
)
def test_retryable_outcomes_release(code: Code) -> None:
    assert settle(code) == "release"


@pytest.mark.parametrize(
    "code", [Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.INTERNAL, Code.FAILED_PRECONDITION]
)
def test_success_and_terminal_outcomes_are_stored(code: Code) -> None:
    assert settle(code) == "store"


def test_lease_is_the_budget_plus_a_margin() -> None:
    assert lease_seconds(3.0, margin_s=2.0) == 5.0
    assert lease_seconds(-1.0, margin_s=2.0) == 2.0


# ---------------------------------------------------------------- the table's state machine


def test_proceed_then_wait_then_replay() -> None:
    table = IdempotencyTable()
    first = table.claim(ticket(token="t1"), now=0, lease_s=10)
    assert first == Proceed(ticket(token="t1"))
    assert table.claim(ticket(token="t2"), now=1, lease_s=10) == Wait(until=10)
    assert table.complete(ticket(token="t1"), OK, now=2, ttl_s=100)
    assert table.claim(ticket(token="t3"), now=3, lease_s=10) == Replay(OK)


def test_different_fingerprint_conflicts_in_flight_and_completed() -> None:
    table = IdempotencyTable()
    table.claim(ticket(), now=0, lease_s=10)
    assert table.claim(ticket("fp-b", "t2"), now=1, lease_s=10) == Conflict()
    table.complete(ticket(), OK, now=2, ttl_s=100)
    assert table.claim(ticket("fp-b", "t3"), now=3, lease_s=10) == Conflict()
    assert table.counters.conflicts == 2


def test_release_lets_the_next_claim_proceed_and_only_the_owner_may_release() -> None:
    table = IdempotencyTable()
    table.claim(ticket(token="owner"), now=0, lease_s=10)
    assert not table.release(ticket(token="intruder"), now=1)
    assert table.release(ticket(token="owner"), now=1)
    assert isinstance(table.claim(ticket(token="retry"), now=2, lease_s=10), Proceed)


def test_a_late_owner_cannot_release_a_newer_claim() -> None:
    table = IdempotencyTable()
    table.claim(ticket(token="old"), now=0, lease_s=5)
    assert isinstance(table.claim(ticket(token="new"), now=6, lease_s=5), Proceed)  # lease passed
    assert not table.release(ticket(token="old"), now=7)
    assert table.claim(ticket(token="third"), now=7, lease_s=5) == Wait(until=11)


def test_terminal_error_is_stored_and_replayed() -> None:
    table = IdempotencyTable()
    table.claim(ticket(), now=0, lease_s=10)
    err = StoredError(int(Code.INVALID_ARGUMENT), "input 'x': bad shape")
    table.complete(ticket(), err, now=1, ttl_s=100)
    assert table.claim(ticket(token="t2"), now=2, lease_s=10) == Replay(err)


def test_first_completion_wins() -> None:
    table = IdempotencyTable()
    table.claim(ticket(token="t1"), now=0, lease_s=10)
    assert table.complete(ticket(token="t1"), OK, now=1, ttl_s=100)
    assert not table.complete(ticket(token="t2"), StoredSuccess(b"other", "4"), now=2, ttl_s=100)
    assert table.claim(ticket(token="t3"), now=3, lease_s=10) == Replay(OK)


def test_completion_after_the_lease_passed_is_still_kept() -> None:
    table = IdempotencyTable()
    table.claim(ticket(), now=0, lease_s=5)
    assert table.complete(ticket(), OK, now=6, ttl_s=100)
    assert table.claim(ticket(token="t2"), now=7, lease_s=5) == Replay(OK)


def test_completion_never_overwrites_another_requests_record() -> None:
    table = IdempotencyTable()
    table.claim(ticket("fp-a", "old"), now=0, lease_s=5)
    table.claim(ticket("fp-b", "new"), now=6, lease_s=5)  # the old claim died; the key was reused
    assert not table.complete(ticket("fp-a", "old"), OK, now=7, ttl_s=100)


def test_in_flight_claim_expires_with_its_lease_and_records_with_their_ttl() -> None:
    table = IdempotencyTable()
    table.claim(ticket(token="dead-owner"), now=0, lease_s=5)
    assert isinstance(table.claim(ticket(token="t2"), now=5, lease_s=5), Proceed)
    table.complete(ticket(token="t2"), OK, now=6, ttl_s=100)
    assert table.claim(ticket(token="t3"), now=105.9, lease_s=5) == Replay(OK)
    assert isinstance(table.claim(ticket(token="t4"), now=106, lease_s=5), Proceed)


def test_the_table_is_bounded_and_evicts_the_oldest_record() -> None:
    table = IdempotencyTable(max_records=3)
    for i in range(4):
        table.claim(ticket(key=f"k{i}", token=f"t{i}"), now=i, lease_s=100)
    assert len(table) == 3 and table.counters.evictions == 1
    assert table.lookup("k0", now=4) is None
    assert table.lookup("k3", now=4) is not None


def test_dead_records_are_dropped_before_live_ones_are_evicted() -> None:
    table = IdempotencyTable(max_records=2)
    table.claim(ticket(key="short", token="a"), now=0, lease_s=1)
    table.claim(ticket(key="long", token="b"), now=0, lease_s=100)
    table.claim(ticket(key="new", token="c"), now=2, lease_s=100)
    assert table.counters.evictions == 0 and table.counters.expired == 1
    assert table.lookup("long", now=2) is not None


def stored(table: IdempotencyTable, tenant: str, key: str, size: int, now: float) -> bool:
    """Claim and complete one record of about `size` response bytes for `tenant`."""
    owner = Ticket(scoped_key=scoped_key(tenant, key), fingerprint="fp", token=key, tenant=tenant)
    assert isinstance(table.claim(owner, now=now, lease_s=10), Proceed)
    return table.complete(owner, StoredSuccess(b"x" * size, "1"), now=now, ttl_s=1000)


def test_the_table_is_bounded_in_bytes() -> None:
    table = IdempotencyTable(max_bytes=100_000)
    for i in range(50):
        assert stored(table, "gold", f"k{i}", 10_000, now=i)
    assert table.bytes <= 100_000 and len(table) < 10
    assert table.counters.evictions > 40
    assert table.lookup(scoped_key("gold", "k49"), now=50) is not None  # the newest stays


def test_a_heavy_tenant_cannot_evict_a_light_tenants_records() -> None:
    table = IdempotencyTable(max_bytes=200_000)
    for i in range(5):
        assert stored(table, "light", f"k{i}", 2_000, now=i)
    light = table.tenant_bytes("light")
    for i in range(200):  # a stream of large responses, far beyond the whole budget
        stored(table, "heavy", f"k{i}", 20_000, now=10 + i)
    assert table.tenant_bytes("light") == light  # every light record is still there
    assert all(table.lookup(scoped_key("light", f"k{i}"), now=300) is not None for i in range(5))
    assert table.bytes <= 200_000


def test_each_of_two_busy_tenants_keeps_half_the_budget() -> None:
    table = IdempotencyTable(max_bytes=400_000)
    for i in range(300):
        for tenant in ("a", "b"):
            stored(table, tenant, f"k{i}", 5_000, now=i)
    assert table.bytes <= 400_000
    assert min(table.tenant_bytes("a"), table.tenant_bytes("b")) >= 400_000 // 2 - 10_000


def test_a_record_larger_than_the_budget_is_not_kept() -> None:
    table = IdempotencyTable(max_bytes=50_000)
    assert not stored(table, "gold", "huge", 60_000, now=0)
    assert table.lookup(scoped_key("gold", "huge"), now=1) is None and table.bytes == 0


def test_same_key_string_in_two_tenants_is_two_records() -> None:
    table = IdempotencyTable()
    gold, silver = scoped_key("gold", "k"), scoped_key("silver", "k")
    table.claim(ticket("fp-a", "t1", key=gold), now=0, lease_s=10)
    table.complete(ticket("fp-a", "t1", key=gold), OK, now=1, ttl_s=100)
    assert isinstance(table.claim(ticket("fp-b", "t2", key=silver), now=2, lease_s=10), Proceed)
    assert isinstance(table.claim(ticket("fp-a", "t3", key=silver), now=2, lease_s=10), Conflict)


def test_on_wake() -> None:
    live = Record("fp-a", State.IN_FLIGHT, "t1", None, until=10)
    assert on_wake(live, "fp-a", now=1) == Pending(10)
    assert on_wake(live, "fp-a", now=10) is None
    assert on_wake(live, "fp-b", now=1) is None
    assert on_wake(Record("fp-a", State.COMPLETED, "t1", OK, until=99), "fp-a", now=1) == OK
    assert on_wake(None, "fp-a", now=1) is None


# ---------------------------------------------------------------- the shared-store encoding


@pytest.mark.parametrize(
    "record",
    [
        Record("fp", State.IN_FLIGHT, "tok", None, math.inf),
        Record("fp", State.COMPLETED, "tok", OK, math.inf),
        Record("fp", State.COMPLETED, "tok", StoredSuccess(b"", ""), math.inf),
        Record("fp", State.COMPLETED, "tok", StoredError(13, "model raised: boom ✗"), math.inf),
    ],
)
def test_record_round_trip(record: Record) -> None:
    assert decode_record(encode_record(record, scoped_key=SK, keys=KEYS), scoped_key=SK, keys=KEYS) == record


def _sealed(body: bytes, key: str = SK) -> bytes:
    """A record of this format around `body`, sealed correctly (as only a buggy writer could make it)."""
    return b"SLI3" + KEYS.seal(b"sluice/idempotency-record/3", key.encode(), body) + body


@pytest.mark.parametrize("bad", [b"", b"SLI3", b"XXXXF\x00\x00\x00\x00-", b"SLI3" + b"\x00" * 40])
def test_malformed_records_are_rejected(bad: bytes) -> None:
    with pytest.raises(RecordRejected) as caught:
        decode_record(bad, scoped_key=SK, keys=KEYS)
    assert not caught.value.old_format


def test_a_sealed_but_malformed_record_is_rejected() -> None:
    for body in (b"F\x00\x05ab", b"D\x00\x02fp\x00\x03tok-"):  # truncated; completed without outcome
        with pytest.raises(RecordRejected):
            decode_record(_sealed(body), scoped_key=SK, keys=KEYS)


def test_records_of_older_formats_are_told_apart() -> None:
    blob = encode_record(Record("fp", State.COMPLETED, "tok", OK, math.inf), scoped_key=SK, keys=KEYS)
    for magic in (b"SLI1", b"SLI2"):
        with pytest.raises(RecordRejected) as caught:
            decode_record(magic + blob[4:], scoped_key=SK, keys=KEYS)
        assert caught.value.old_format


def test_only_a_holder_of_the_key_can_make_a_record_for_its_key() -> None:
    record = Record("fp", State.COMPLETED, "tok", OK, math.inf)
    forged = encode_record(record, scoped_key=SK, keys=SealKeys([b"y" * 32]))
    elsewhere = encode_record(record, scoped_key=scoped_key("gold", "other"), keys=KEYS)
    flipped = bytearray(encode_record(record, scoped_key=SK, keys=KEYS))
    flipped[-1] ^= 0x01
    for bad in (forged, elsewhere, bytes(flipped)):
        with pytest.raises(RecordRejected) as caught:
            decode_record(bad, scoped_key=SK, keys=KEYS)
        assert not caught.value.old_format


# ---------------------------------------------------------------- the in-process store and acquire


async def test_waiters_get_the_owners_outcome() -> None:
    clock = FakeClock()
    store = InProcessIdempotencyStore(clock=clock)
    owner = await acquire(store, SK, "fp-a", lease_s=10, wait_s=10, clock=clock)
    assert isinstance(owner, Proceed)
    waiters = [
        asyncio.create_task(acquire(store, SK, "fp-a", lease_s=10, wait_s=10, clock=clock)) for _ in range(5)
    ]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    assert await store.complete(owner.ticket, OK)
    assert [await w for w in waiters] == [Replay(OK)] * 5
    assert store.stats.proceeds == 1 and store.stats.waits == 5


async def test_release_lets_exactly_one_waiter_proceed() -> None:
    clock = FakeClock()
    store = InProcessIdempotencyStore(clock=clock)
    owner = await store.claim(SK, "fp-a", lease_s=10)
    assert isinstance(owner, Proceed)
    waiters = [
        asyncio.create_task(acquire(store, SK, "fp-a", lease_s=10, wait_s=10, clock=clock)) for _ in range(3)
    ]
    await asyncio.sleep(0)
    assert await store.release(owner.ticket)
    done, pending = await asyncio.wait(waiters, timeout=1, return_when=asyncio.FIRST_COMPLETED)
    for _ in range(5):
        await asyncio.sleep(0)  # give the others every chance to (wrongly) finish too
    assert len(done) == 1 and not any(w.done() for w in pending)
    winner = next(iter(done)).result()
    assert isinstance(winner, Proceed)
    await store.complete(winner.ticket, OK)
    assert [await w for w in pending] == [Replay(OK)] * 2


async def test_acquire_raises_on_conflict() -> None:
    clock = FakeClock()
    store = InProcessIdempotencyStore(clock=clock)
    await store.claim(SK, "fp-a", lease_s=10)
    with pytest.raises(SluiceError) as caught:
        await acquire(store, SK, "fp-b", lease_s=10, wait_s=10, clock=clock)
    assert caught.value.code == Code.FAILED_PRECONDITION


async def test_acquire_gives_up_at_its_budget_while_the_owner_still_runs() -> None:
    clock = FakeClock()
    store = InProcessIdempotencyStore(clock=clock)
    await store.claim(SK, "fp-a", lease_s=10)
    with pytest.raises(SluiceError) as caught:
        await acquire(store, SK, "fp-a", lease_s=10, wait_s=0, clock=clock)
    assert caught.value.code == Code.DEADLINE_EXCEEDED


async def test_a_waiter_takes_over_when_the_owners_lease_ends() -> None:
    clock = FakeClock()
    store = InProcessIdempotencyStore(clock=clock)
    await store.claim(SK, "fp-a", lease_s=5)
    clock.advance(5)  # the owner died silently; its lease is over
    assert isinstance(await acquire(store, SK, "fp-a", lease_s=5, wait_s=1, clock=clock), Proceed)
