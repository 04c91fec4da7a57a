"""The etcd registry I/O layer: leased registrations and prefix watches that survive etcd outages.

Key layout (DESIGN §6), under the configured prefix (default `/sluice/`): `workers/<id>` and
`routers/<id>` are bound to their owner's lease; `tenants/<name>` holds optional live overrides.

Invariants, and why:
- A `LeasedKey` owns one lease and one aetcd client at a time. Every etcd call it makes runs under one
  lock, so the keepalive loop and `update()` never race over which lease or client is current.
- While a `LeasedKey` runs, its key is in etcd under a live lease holding the latest value given to it,
  or the keepalive loop is working towards that: if etcd is unreachable it retries with a short, bounded
  backoff; if the lease is gone (expired during a long outage, revoked, or etcd came back without it) it
  grants a new lease and writes the current value. A frozen or killed owner stops refreshing, so its key
  vanishes after at most the lease TTL: routers never route to a process that is gone for longer.
- `revoke()` is the only way a registration ends on purpose; it removes the key at once (revoking the
  lease), is idempotent, and is bounded in time even when etcd is down (the key then vanishes at TTL).
- Prefix watches live in common/etcd_watch.py and share this module's client, backoff and error set.
- aetcd neither keeps leases alive nor reconnects a broken watch, and a gRPC channel can sit in a long
  reconnect backoff after an outage: after any failure we drop the client and open a fresh one. That is
  also how an expired etcd auth token is renewed: the fresh client authenticates (common/etcd_client.py).
- Every request/response etcd call is bounded by `RPC_TIMEOUT_S` (aetcd's per-call deadline), and an
  open watch stream is pinged by gRPC (a dead peer breaks it in ~15 s), so nothing here hangs on an etcd
  that is frozen or cut off.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable
from typing import Any, Final

import aetcd
import aetcd.exceptions

from sluice_inference.common.etcd_client import EtcdClient
from sluice_inference.common.tls import channel_credentials
from sluice_inference.common.trust_settings import EtcdSettings

logger = logging.getLogger(__name__)

WORKERS: Final = "workers/"
ROUTERS: Final = "routers/"
TENANTS: Final = "tenants/"

RPC_TIMEOUT_S: Final = 2.0
"""Deadline of one etcd call; also bounds how long opening a client waits for an answer."""
REVOKE_TIMEOUT_S: Final = 3.0
"""Longest `LeasedKey.revoke()` spends talking to etcd before giving up (the key then expires at TTL)."""
CLOSE_TIMEOUT_S: Final = 2.0
"""Longest closing one client may take."""
WATCH_BACKOFF_S: Final = (0.1, 2.0)
"""First and largest delay between attempts to re-establish a broken watch."""

# Reconnect quickly once etcd returns (gRPC's default backoff grows to minutes). Ping an open watch
# every 10 s so a frozen or partitioned etcd breaks it within ~15 s instead of hanging it: grpcio 1.85
# enforces the ping-ack deadline through `ping_timeout_ms` (default 60 s), not `keepalive_timeout_ms`,
# and stops pinging an idle stream after 2 pings unless `max_pings_without_data` is 0. etcd accepts
# pings every 5 s or slower while a call is open (its default enforcement policy). A local subchannel
# pool makes a new client really dial anew: with gRPC's default global pool it would share the old
# client's connection, still in reconnect backoff, and fail with "connection refused" after etcd is back.
_CHANNEL_OPTIONS: Final[dict[str, Any]] = {
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.ping_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,
}


class EtcdUnavailable(Exception):
    """No configured etcd endpoint answered within the bound."""


# What "etcd did not answer (properly)" looks like: aetcd maps the gRPC errors of the calls used here to
# ClientError; its connect() and our own bounds time out.
ETCD_ERRORS: Final = (aetcd.exceptions.ClientError, OSError, TimeoutError, EtcdUnavailable)


def raise_if_cancelling() -> None:
    """Honour a cancel that the etcd client (or a cleanup) replaced with an error of its own.

    aetcd can answer a call cancelled under it with its own error (`ConnectionFailedError`) instead of
    CancelledError, and a failing cleanup replaces the CancelledError too. Code that treats etcd errors as
    an outage and goes on must call this first, or its task outlives its cancel and the stop that sent it
    times out (a router's stop took over 5 s on fresh-clone CI runs)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split `host:port` (or `[v6addr]:port`) into host and port; ValueError naming the problem."""
    text = endpoint.strip()
    if "://" in text:
        raise ValueError(f"etcd endpoint {endpoint!r}: give host:port without a scheme")
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
    else:
        host, sep, port_text = text.rpartition(":")
    if not sep or not host or (":" in host and not text.startswith("[")):
        raise ValueError(f"etcd endpoint {endpoint!r}: expected host:port")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"etcd endpoint {endpoint!r}: port must be a number in 1..65535")
    return host, int(port_text)


def _child_key(prefix: str, folder: str, name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"{folder}{name!r}: a registry name must be non-empty and contain no '/'")
    return f"{prefix}{folder}{name}"


def worker_key(prefix: str, worker_id: str) -> str:
    """Full key of a worker's registration: `<prefix>workers/<worker_id>`."""
    return _child_key(prefix, WORKERS, worker_id)


def router_key(prefix: str, router_id: str) -> str:
    """Full key of a router's registration: `<prefix>routers/<router_id>`."""
    return _child_key(prefix, ROUTERS, router_id)


def tenant_key(prefix: str, tenant: str) -> str:
    """Full key of a tenant's live overrides: `<prefix>tenants/<tenant>`."""
    return _child_key(prefix, TENANTS, tenant)


async def close_within(closing: Awaitable[object], seconds: float, what: str) -> None:
    """Run a close for at most `seconds`, then leave it behind.

    `asyncio.wait_for` is no bound here: on its timeout it cancels the close and then waits for the
    cancellation to finish, and an aetcd close that does not answer its cancel held a router's stop past
    its 5 s step. A close left behind runs on in its own task (its result is read, so nothing is logged
    as never retrieved); a failure only leaks a channel that gRPC tears down anyway."""
    task = asyncio.ensure_future(closing)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)
        logger.debug("closing %s: not done within %.1f s, left behind", what, seconds)
        return
    _retrieve(task)


def _retrieve(task: asyncio.Future[object]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, (*ETCD_ERRORS, RuntimeError)):
        raise exc
    if exc is not None:
        logger.debug("closing an etcd client or watch failed: %r", exc)


async def close_client(client: aetcd.Client) -> None:
    """Close a client within `CLOSE_TIMEOUT_S`."""
    await close_within(client.close(), CLOSE_TIMEOUT_S, "an etcd client")


def new_client(settings: EtcdSettings, host: str, port: int) -> aetcd.Client:
    """An unconnected client for one endpoint, with the configured TLS and etcd user. Certificate files
    are read here, at every (re)connect, so renewed certificates are picked up without a restart."""
    credentials = None
    if settings.uses_tls:
        credentials = channel_credentials(
            ca_file=settings.ca_file, cert_file=settings.cert_file, key_file=settings.key_file, section="etcd"
        )
    return EtcdClient(
        host,
        port,
        credentials=credentials,
        username=settings.username,
        password=settings.password_value(),
        timeout=RPC_TIMEOUT_S,
        options=_CHANNEL_OPTIONS,
    )


async def open_client(settings: EtcdSettings) -> aetcd.Client:
    """A client connected to the first endpoint of `settings.endpoints` that answers a read.

    aetcd connects lazily, so each endpoint is probed with a bounded read of the prefix (which also
    authenticates, when an etcd user is configured). Raises `EtcdUnavailable` (listing each endpoint's
    error) when none answers.
    """
    errors: list[str] = []
    for endpoint in settings.endpoints:
        host, port = parse_endpoint(endpoint)
        client = new_client(settings, host, port)
        try:
            await asyncio.wait_for(client.get(settings.prefix.encode()), RPC_TIMEOUT_S)
        except ETCD_ERRORS as exc:
            errors.append(f"{endpoint}: {exc!r}")
            await close_client(client)
            continue
        except BaseException:
            await close_client(client)
            raise
        return client
    raise EtcdUnavailable("no etcd endpoint answered: " + "; ".join(errors))


class Backoff:
    """Exponential delays between `initial` and `maximum`, with jitter so many clients do not retry
    in lockstep when etcd returns."""

    def __init__(self, initial: float, maximum: float) -> None:
        self._initial = initial
        self._maximum = maximum
        self._next = initial

    def delay(self) -> float:
        """The next delay in seconds; each call doubles the following one, up to `maximum`."""
        current = self._next
        self._next = min(self._next * 2, self._maximum)
        return current * random.uniform(0.8, 1.0)

    def reset(self) -> None:
        """Start again from `initial` (after a success)."""
        self._next = self._initial


class LeasedKey:
    """A key kept alive under a lease: worker and router registrations (DESIGN §6).

    Lifecycle: `start()` → any number of `update()` → `revoke()`. Between `start()` and `revoke()` one
    background task refreshes the lease every TTL/3 and re-registers after outages (module docstring).
    """

    def __init__(self, settings: EtcdSettings, key: str, value: bytes) -> None:
        if not key.startswith(settings.prefix):
            raise ValueError(f"key {key!r} is outside the registry prefix {settings.prefix!r}")
        self._settings = settings
        self._key = key
        self._value = value
        self._client: aetcd.Client | None = None
        self._lease_id: int | None = None
        self._dirty = False  # `_value` not yet written under the current lease
        self._connected = False
        self._task: asyncio.Task[None] | None = None
        self._revoked = False
        self._io = asyncio.Lock()  # held by every etcd call; see the module invariants

    @property
    def key(self) -> str:
        """The full key, prefix included."""
        return self._key

    @property
    def lease_id(self) -> int | None:
        """ID of the current lease; None before `start()`, after `revoke()`, or between leases."""
        return self._lease_id

    @property
    def connected(self) -> bool:
        """False while the keepalive cannot reach etcd (the key may then expire in etcd)."""
        return self._connected

    async def start(self) -> None:
        """Grant a lease, write the key under it and start the keepalive; EtcdUnavailable if etcd
        cannot be reached now (nothing is left running then)."""
        if self._task is not None or self._revoked:
            raise RuntimeError(f"LeasedKey {self._key!r} was already started")
        async with self._io:
            try:
                await self._register()
            except BaseException as exc:
                await self._drop_client()
                if isinstance(exc, ETCD_ERRORS) and not isinstance(exc, EtcdUnavailable):
                    raise EtcdUnavailable(f"could not register {self._key!r}: {exc!r}") from exc
                raise
        self._connected = True
        self._task = asyncio.create_task(self._keep_alive(), name=f"etcd keepalive {self._key}")

    async def update(self, value: bytes) -> None:
        """Replace the value under the same lease. If etcd cannot take it now, the value is kept and
        written by the keepalive loop as soon as etcd answers (or on re-registration)."""
        if self._revoked:
            raise RuntimeError(f"LeasedKey {self._key!r} was revoked")
        self._value = value
        self._dirty = True
        async with self._io:
            if self._client is None or self._lease_id is None:
                return  # not started, or in an outage: the keepalive loop writes it
            try:
                await self._client.put(self._key.encode(), value, lease=self._lease_id)
            except ETCD_ERRORS as exc:
                raise_if_cancelling()
                logger.warning("etcd: could not update %s now (%r); will retry on reconnect", self._key, exc)
                return
            if self._value is value:
                self._dirty = False

    async def revoke(self) -> None:
        """Stop the keepalive, revoke the lease (the key disappears at once) and close the client.

        Idempotent. Bounded by `REVOKE_TIMEOUT_S` when etcd is down; the key then expires at TTL.
        """
        if self._revoked:
            return
        self._revoked = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        async with self._io:
            lease_id, self._lease_id = self._lease_id, None
            self._connected = False
            try:
                if lease_id is not None:
                    await asyncio.wait_for(self._revoke_lease(lease_id), REVOKE_TIMEOUT_S)
            except ETCD_ERRORS as exc:
                raise_if_cancelling()
                logger.warning(
                    "etcd: could not revoke the lease of %s (%r); it expires within %d s",
                    self._key,
                    exc,
                    self._settings.lease_ttl_s,
                )
            finally:
                await self._drop_client()

    async def __aenter__(self) -> LeasedKey:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.revoke()

    async def _revoke_lease(self, lease_id: int) -> None:
        client = await self._ensure_client()
        try:
            await client.revoke_lease(lease_id)
        except aetcd.exceptions.UnauthenticatedError:
            # The client's etcd auth token expired while idle: a fresh client authenticates again.
            await self._drop_client()
            client = await self._ensure_client()
            await client.revoke_lease(lease_id)

    async def _ensure_client(self) -> aetcd.Client:
        if self._client is None:
            self._client = await open_client(self._settings)
        return self._client

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await close_client(client)

    async def _register(self) -> None:
        """Grant a new lease and write the current value under it (caller holds `_io`)."""
        client = await self._ensure_client()
        lease = await client.lease(self._settings.lease_ttl_s)
        lease_id = int(lease.id)
        value = self._value
        await client.put(self._key.encode(), value, lease=lease_id)
        self._lease_id = lease_id
        self._dirty = self._value is not value
        logger.info("etcd: registered %s under lease %x", self._key, lease_id)

    async def _refresh(self) -> None:
        """One keepalive round (caller holds `_io`): refresh the lease, or re-register if it is gone;
        then write a value that an earlier `update()` could not."""
        client = await self._ensure_client()
        if self._lease_id is None:
            await self._register()
            return
        reply = await client.refresh_lease(self._lease_id)
        ttl = int(reply.TTL) if reply is not None else 0
        if ttl <= 0:
            logger.warning("etcd: lease %x of %s is gone; re-registering", self._lease_id, self._key)
            self._lease_id = None
            await self._register()
        elif self._dirty:
            value = self._value
            await client.put(self._key.encode(), value, lease=self._lease_id)
            self._dirty = self._value is not value

    async def _beat(self) -> bool:
        """One guarded keepalive round; True when etcd answered. Never raises except on cancel."""
        async with self._io:
            try:
                await self._refresh()
            except ETCD_ERRORS as exc:
                raise_if_cancelling()
                if self._connected:
                    logger.warning("etcd: cannot keep %s alive (%r); retrying", self._key, exc)
                self._connected = False
                await self._drop_client()
                return False
            except Exception:
                # A bug here must not end the registration: log it loudly and treat it as an outage.
                raise_if_cancelling()
                logger.exception("etcd: unexpected error keeping %s alive; retrying", self._key)
                self._connected = False
                await self._drop_client()
                return False
        if not self._connected:
            logger.warning("etcd: reachable again; %s is registered (lease %x)", self._key, self._lease_id)
        self._connected = True
        return True

    async def _keep_alive(self) -> None:
        interval = self._settings.lease_ttl_s / 3
        backoff = Backoff(0.1, min(1.0, interval))
        delay = interval
        while True:
            await asyncio.sleep(delay)
            if await self._beat():
                backoff.reset()
                delay = interval
            else:
                delay = backoff.delay()
