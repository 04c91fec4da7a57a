"""Redis plumbing shared by the stores: a bounded, fail-fast client, an outage tracker, and one shared
pub/sub connection that wakes local waiters by channel.

Why these choices:
- `BlockingConnectionPool`: redis-py's default pool raises past its size instead of waiting
  (DEPENDENCIES.md); a short pool timeout still bounds the wait.
- Short socket timeouts (0.2 s) and one immediate retry: a retry reconnects a connection that a Redis
  restart broke, while a dead or hung Redis costs a request well under a second, never a hang.
- `Outage`: after a failure the stores skip Redis for a short back-off, so a hung server costs one timeout
  per back-off rather than one per request, and the outage is logged once (and once when it ends).
- `Subscriber`: waiters in one router share one pub/sub connection (a connection per waiter would drain the
  pool that the completing owner needs). `watch` returns only after Redis confirmed the subscription, so a
  waiter that then re-reads state cannot miss a later publish; if the connection drops, every waiter is
  woken to re-read (and meet the outage), and the next `watch` reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from sluice_inference.common.clock import Clock, MonotonicClock, wait_until

log = logging.getLogger(__name__)

REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
"""What a Redis call can raise when the server is down, hung or unreachable."""


@dataclass(frozen=True)
class RedisOptions:
    """How the router talks to Redis (mapped from the router's typed config by the shell)."""

    url: str
    """e.g. redis://127.0.0.1:6379/0, or rediss://... for TLS"""
    username: str | None = None
    """ACL user; None: the default user."""
    password: str | None = None
    """AUTH password (kept out of the URL so it never shows up where a URL is printed)."""
    ca_file: Path | None = None
    """rediss:// only: CA bundle the server certificate is verified against (None: system roots)."""
    cert_file: Path | None = None
    """rediss:// only: client certificate (with `key_file`)."""
    key_file: Path | None = None
    """rediss:// only: the client certificate's private key."""
    prefix: str = "sluice:"
    """Prepended to every key and channel, so several clusters can share one Redis."""
    socket_timeout_s: float = 0.2
    """Per read/write; what a hung Redis costs a request (times 1 + retries)."""
    connect_timeout_s: float = 0.2
    """Per connection attempt."""
    max_connections: int = 64
    """Pool size; callers past it wait up to `pool_timeout_s`."""
    pool_timeout_s: float = 0.2
    """Longest wait for a free pooled connection."""
    retries: int = 1
    """Immediate retries on a connection error (one reconnects after a Redis restart)."""
    down_backoff_s: float = 1.0
    """After a failure, Redis is skipped this long before the next attempt."""


def open_redis(options: RedisOptions) -> Redis:
    """A client owning a blocking, bounded pool with the timeouts of `options` (connects lazily);
    `await client.aclose()` closes the pool's connections. With a rediss:// URL the server certificate
    is always verified (and its host name checked)."""
    tls: dict[str, Any] = {}
    if options.url.startswith("rediss://"):
        tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
        for name, path in (("ssl_ca_certs", options.ca_file), ("ssl_certfile", options.cert_file),
                           ("ssl_keyfile", options.key_file)):  # fmt: skip
            if path is not None:
                tls[name] = str(path)
    pool = BlockingConnectionPool.from_url(
        options.url,
        username=options.username,
        password=options.password,
        **tls,
        max_connections=options.max_connections,
        timeout=options.pool_timeout_s,
        socket_timeout=options.socket_timeout_s,
        socket_connect_timeout=options.connect_timeout_s,
        retry=Retry(NoBackoff(), options.retries),
    )
    return Redis.from_pool(pool)


class Outage:
    """Whether Redis is usable now; counts errors and outages, logs each outage's start and end once."""

    def __init__(self, what: str, *, backoff_s: float = 1.0, clock: Clock | None = None) -> None:
        self.what = what
        self.backoff_s = backoff_s
        self.errors = 0
        self.outages = 0
        self.down = False
        self._clock = clock or MonotonicClock()
        self._skip_until = 0.0

    def skipping(self) -> bool:
        """True while in the back-off after a failure: callers should not touch Redis."""
        return self._clock.now() < self._skip_until

    def retry_after_s(self) -> float:
        """Seconds until Redis is tried again (at least a short floor, for retry hints)."""
        return max(self._skip_until - self._clock.now(), 0.05)

    def failed(self, exc: BaseException) -> None:
        """Record a failed call and start the back-off."""
        self.errors += 1
        self._skip_until = self._clock.now() + self.backoff_s
        if not self.down:
            self.down = True
            self.outages += 1
            log.warning("%s: Redis unreachable (%s: %s)", self.what, type(exc).__name__, exc)

    def succeeded(self) -> None:
        """Record a successful call (ends an outage)."""
        self._skip_until = 0.0
        if self.down:
            self.down = False
            log.info("%s: Redis reachable again", self.what)


def _retrieved(future: asyncio.Future[None]) -> None:
    """Mark a confirmation's failure as seen (asyncio logs an exception nobody retrieved)."""
    if not future.cancelled():
        future.exception()


class Subscriber:
    """One pub/sub connection for a store; `watch(channel)` yields an Event set on each message there."""

    def __init__(self, client: Redis, *, clock: Clock, confirm_timeout_s: float = 0.5) -> None:
        self._client = client
        self._clock = clock
        self._confirm_timeout_s = confirm_timeout_s
        self._pubsub: PubSub | None = None
        self._listener: asyncio.Task[None] | None = None
        self._events: dict[str, set[asyncio.Event]] = {}
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def watch(self, channel: str) -> AsyncIterator[asyncio.Event]:
        """Subscribe for the duration of the block, returning once Redis confirmed it (or after
        `confirm_timeout_s`); raises a REDIS_ERRORS member if the connection fails."""
        event = asyncio.Event()
        try:
            confirmed = await self._add(channel, event)
            # A late confirmation (a loaded Redis) is not an error: waiters re-read on a timer anyway, so
            # the worst case is a wake-up delayed to that timer. A lost connection does raise.
            confirmed.add_done_callback(_retrieved)  # a failure after we stopped waiting is not an orphan
            if await wait_until(self._clock, {confirmed}, self._clock.now() + self._confirm_timeout_s):
                confirmed.result()  # raises if the connection failed
            yield event
        finally:
            await self._discard(channel, event)

    async def close(self) -> None:
        """Stop listening and close the connection; wakes any waiter."""
        async with self._lock:
            await self._reset(ConnectionError("subscriber closed"))

    async def _add(self, channel: str, event: asyncio.Event) -> asyncio.Future[None]:
        async with self._lock:
            watchers = self._events.setdefault(channel, set())
            watchers.add(event)
            if channel in self._confirmed:
                return self._confirmed[channel]
            pubsub = self._pubsub or self._open()
            future = asyncio.get_running_loop().create_future()
            self._confirmed[channel] = future
            try:
                await pubsub.subscribe(channel)
            except REDIS_ERRORS as exc:
                await self._reset(exc)
                raise
            self._ensure_listener(pubsub)
            return future

    async def _discard(self, channel: str, event: asyncio.Event) -> None:
        async with self._lock:
            watchers = self._events.get(channel)
            if watchers is None:
                return
            watchers.discard(event)
            if watchers:
                return
            del self._events[channel]
            self._confirmed.pop(channel, None)
            if self._pubsub is not None:
                try:
                    await self._pubsub.unsubscribe(channel)
                except REDIS_ERRORS as exc:
                    await self._reset(exc)

    def _open(self) -> PubSub:
        self._pubsub = self._client.pubsub()
        return self._pubsub

    def _ensure_listener(self, pubsub: PubSub) -> None:
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen(pubsub), name="redis-subscriber")

    async def _listen(self, pubsub: PubSub) -> None:
        try:
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is not None:
                    self._dispatch(message)
        except REDIS_ERRORS as exc:
            log.debug("pub/sub connection lost: %s", exc)
            async with self._lock:
                if self._pubsub is pubsub:
                    self._listener = None  # we are that task: _reset must not cancel it
                    await self._reset(exc)

    def _dispatch(self, message: dict[str, Any]) -> None:
        channel = message["channel"]
        name = channel.decode() if isinstance(channel, bytes) else str(channel)
        if message["type"] == "subscribe":
            future = self._confirmed.get(name)
            if future is not None and not future.done():
                future.set_result(None)
        elif message["type"] == "message":
            for event in self._events.get(name, ()):
                event.set()

    async def _reset(self, exc: BaseException) -> None:
        """Drop the connection; fail pending confirmations and wake every waiter to re-read state."""
        listener, self._listener = self._listener, None
        if listener is not None and listener is not asyncio.current_task():
            listener.cancel()
            await asyncio.wait({listener})  # unlike `await listener`, never swallows our own cancellation
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
        for future in self._confirmed.values():
            if not future.done():
                future.set_exception(ConnectionError(f"subscription lost: {exc}"))
                future.exception()  # retrieved here: a waiter may have left already
        self._confirmed.clear()
        for watchers in self._events.values():
            for event in watchers:
                event.set()
