"""etcd with TLS and authentication (docs/design.md §9): a worker's registration and a router's watch work
through both, wrong or missing credentials are refused, and an expired auth token is renewed.

etcd here serves TLS with a `sluice certs dev` certificate and has `root` with a password (`etcdctl user
add`, `auth enable`, as an operator does it). Its auth tokens live 1 s when idle, so a keepalive every 2 s
meets an expired token on every round.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from sluice_inference.common.dev_certs import write_dev_certs
from sluice_inference.common.etcd import WORKERS, EtcdUnavailable, LeasedKey, open_client, worker_key
from sluice_inference.common.etcd_watch import watch_prefix_snapshots
from sluice_inference.common.trust_settings import EtcdSettings
from tests.support.etcd_server import EtcdServer
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

PASSWORD = "etcd-test-password"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A development CA and certificates (etcd.pem serves 127.0.0.1)."""
    folder = tmp_path_factory.mktemp("certs")
    write_dev_certs(folder)
    return folder


@pytest.fixture
def secure_etcd(certs: Path) -> Iterator[EtcdServer]:
    """etcd over TLS with authentication on and 1 s auth tokens; stopped at teardown."""
    server = EtcdServer(certs=certs, auth_token_ttl_s=1)
    try:
        server.start()
        server.enable_auth(PASSWORD)
        yield server
    finally:
        server.cleanup()


def settings_for(server: EtcdServer, certs: Path, **changes: object) -> EtcdSettings:
    """Settings with TLS (the dev CA) and the root user, a unique prefix; `changes` override."""
    fields: dict[str, object] = {
        "endpoints": [server.endpoint],
        "prefix": f"/sluice-test-{uuid.uuid4().hex[:12]}/",
        "lease_ttl_s": 2,
        "ca_file": certs / "ca.pem",
        "username": "root",
        "password": SecretStr(PASSWORD),
        **changes,
    }
    return EtcdSettings.model_validate(fields)


@contextlib.asynccontextmanager
async def following(settings: EtcdSettings) -> AsyncIterator[list[dict[str, bytes]]]:
    """Snapshots of `workers/` as a router's membership sees them, collected in the background."""
    seen: list[dict[str, bytes]] = []

    async def follow() -> None:
        async for snapshot in watch_prefix_snapshots(settings, settings.prefix + WORKERS):
            seen.append(snapshot)

    task = asyncio.create_task(follow())
    try:
        yield seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_registration_and_watch_over_tls_as_an_etcd_user(
    secure_etcd: EtcdServer, certs: Path, tmp_path: Path
) -> None:
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    settings = settings_for(secure_etcd, certs, password=None, password_file=password_file)
    async with following(settings) as seen:  # the watch outlives the key, or it could miss the delete
        async with LeasedKey(settings, worker_key(settings.prefix, "w1"), b"v1"):
            await eventually(lambda: bool(seen) and seen[-1].get("w1") == b"v1", 10, "the watch to see w1")
        await eventually(lambda: "w1" not in seen[-1], 10, "the watch to see w1 leave")


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"password": SecretStr("wrong")}, "a wrong password"),
        ({"username": None, "password": None}, "no user"),
        ({"ca_file": None}, "plaintext to a TLS port"),
    ],
)
async def test_wrong_or_missing_credentials_are_refused(
    secure_etcd: EtcdServer, certs: Path, change: dict[str, object], what: str
) -> None:
    settings = settings_for(secure_etcd, certs, **change)
    with pytest.raises(EtcdUnavailable):
        await LeasedKey(settings, worker_key(settings.prefix, "w1"), b"v1").start()
    secure_etcd.etcdctl("get", "--prefix", settings.prefix, password=PASSWORD)  # etcd itself is fine


async def test_an_expired_auth_token_is_renewed(secure_etcd: EtcdServer, certs: Path) -> None:
    # Keepalive every 2 s, tokens expire after 1 s idle: each refresh meets an expired token, drops the
    # client and authenticates again; the registration must hold and take updates all along.
    settings = settings_for(secure_etcd, certs, lease_ttl_s=6)
    key = worker_key(settings.prefix, "w1")
    async with following(settings) as seen:
        async with LeasedKey(settings, key, b"v1") as registration:
            await eventually(lambda: bool(seen) and seen[-1].get("w1") == b"v1", 10, "w1 registered")
            registered = len(seen) - 1
            await asyncio.sleep(2.5)  # longer than the token's 1 s life: the client's token has expired
            await registration.update(b"v2")
            await eventually(lambda: seen[-1].get("w1") == b"v2", 10, "the update after token expiry")
            await asyncio.sleep(4.5)  # two more keepalive rounds, each past an expired token
            assert all("w1" in snapshot for snapshot in seen[registered:]), "the registration lapsed"
            assert registration.connected
            await asyncio.sleep(1.5)  # idle again: revoking meets an expired token too
        # revoked (not expired: the lease has 6 s): the key is gone at once
        assert await stored(settings, key) is None


async def stored(settings: EtcdSettings, key: str) -> bytes | None:
    """The key's value through a fresh client; None when absent."""
    client = await open_client(settings)
    try:
        found = await client.get(key.encode())
    finally:
        await client.close()
    return None if found is None else bytes(found.value)
