"""deploy/base/etcd-rbac.sh against a real etcd: after it, a worker's credential cannot write routers/ or
tenants/, a router's cannot write workers/ or tenants/, and only an operator's writes tenants/ — so the
holder of a stolen worker or router credential cannot grant tenants anything (and overrides only take away
anyway: router/policy/overrides.py). Users get passwords here; deployments use certificates."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest
from pydantic import SecretStr

from sluice_inference.common.etcd import open_client
from sluice_inference.common.local_cluster import etcd_binary
from sluice_inference.common.trust_settings import EtcdSettings
from tests.support.etcd_server import EtcdServer

pytestmark = pytest.mark.integration

ROOT_PASSWORD = "rbac-root-password"
SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "base" / "etcd-rbac.sh"


@pytest.fixture
def rbac_etcd() -> Iterator[tuple[EtcdServer, str]]:
    """etcd with the script applied twice (it is idempotent) under a fresh prefix; its users exist
    beforehand with a password equal to their name (the script gives them roles, and keeps them)."""
    server = EtcdServer()
    prefix = f"/sluice-{uuid.uuid4().hex[:8]}/"
    try:
        server.start()
        server.enable_auth(ROOT_PASSWORD)
        env = {
            **os.environ,
            "ETCDCTL_ENDPOINTS": f"http://{server.endpoint}",
            "ETCDCTL_USER": f"root:{ROOT_PASSWORD}",
            "ETCDCTL_BIN": str(etcd_binary().with_name("etcdctl")),
            "SLUICE_ETCD_PREFIX": prefix,
        }
        for user in ("sluice-router", "sluice-worker", "sluice-operator"):  # the script keeps these users
            server.etcdctl("user", "add", f"{user}:{user}", password=ROOT_PASSWORD)
        for _ in range(2):
            done = subprocess.run(
                ["sh", str(SCRIPT)], check=False, env=env, capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 0, done.stderr
        yield server, prefix
    finally:
        server.cleanup()


async def can_write(server: EtcdServer, prefix: str, user: str, key: str) -> bool:
    """Whether `user` may put `key` (connecting as Sluice does, which reads the prefix key first)."""
    settings = EtcdSettings(
        endpoints=[server.endpoint], prefix=prefix, username=user, password=SecretStr(user)
    )
    client = await open_client(settings)
    try:
        await client.put(key.encode(), b"{}")
    except aetcd.exceptions.ClientError:
        return False
    finally:
        await client.close()
    return True


@pytest.mark.parametrize(
    ("user", "allowed"),
    [
        ("sluice-router", {"routers/"}),
        ("sluice-worker", {"workers/"}),
        ("sluice-operator", {"tenants/"}),
    ],
)
async def test_each_user_writes_only_its_own_prefix(
    rbac_etcd: tuple[EtcdServer, str], user: str, allowed: set[str]
) -> None:
    server, prefix = rbac_etcd
    for folder in ("workers/", "routers/", "tenants/"):
        assert await can_write(server, prefix, user, f"{prefix}{folder}x") == (folder in allowed), (
            user,
            folder,
        )
    assert not await can_write(server, prefix, user, "/elsewhere/x")
