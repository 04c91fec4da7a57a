"""router/auth.py's AccessPolicy: which credential each method needs (no server; the directory is real)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from sluice_inference.common.errors import PermissionDenied, SluiceError, Unauthenticated
from sluice_inference.common.serving_settings import ANONYMOUS_TENANT, TenantSettings
from sluice_inference.router.auth import AccessPolicy, TenantKeys
from sluice_inference.router.policy.tenants import Tenant, TenantDirectory, hash_api_key

ADMIN = "/sluice.v1.RouterAdmin/ListTenants"
INFER = "/inference.GRPCInferenceService/ModelInfer"
OPEN = (
    "/grpc.health.v1.Health/Check",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/inference.GRPCInferenceService/ServerMetadata",
)
KEYED = {
    "gold": TenantSettings(api_keys=[hash_api_key("gold-key")]),
    "ops": TenantSettings(api_keys=[hash_api_key("ops-key")], admin=True),
}
LOCAL = {ANONYMOUS_TENANT: TenantSettings()}


def policy(
    tenants: dict[str, TenantSettings], admin_keys: tuple[str, ...] = (), require_api_key: bool = False
) -> AccessPolicy:
    directory = TenantDirectory(tenants, require_api_key=require_api_key)
    return AccessPolicy(
        TenantKeys(lambda: directory),
        admin_keys=[hash_api_key(k) for k in admin_keys],
        require_api_key=require_api_key,
    )


def refusal(check: AccessPolicy, method: str, key: str | None) -> type[SluiceError] | None:
    try:
        check.check(method, key)
    except SluiceError as err:
        return type(err)
    return None


@pytest.mark.parametrize("method", OPEN)
def test_probes_need_nothing_even_when_keys_are_required(method: str) -> None:
    assert refusal(policy(KEYED, require_api_key=True), method, None) is None


def test_admin_needs_an_admin_key_or_an_admin_tenant() -> None:
    check = policy(KEYED, admin_keys=("root",))
    assert refusal(check, ADMIN, None) is Unauthenticated
    assert refusal(check, ADMIN, "who-knows") is Unauthenticated
    assert refusal(check, ADMIN, "gold-key") is PermissionDenied
    assert refusal(check, ADMIN, "ops-key") is None
    assert refusal(check, ADMIN, "root") is None


def test_unlisted_methods_are_admin_only() -> None:
    assert refusal(policy(KEYED), "/sluice.v1.Future/Method", "gold-key") is PermissionDenied


@pytest.mark.parametrize(
    ("tenants", "admin_keys", "require_api_key", "open_"),
    [
        (LOCAL, (), False, True),  # key-less local mode
        (LOCAL, ("root",), False, False),  # an admin key exists: it is needed
        (LOCAL, (), True, False),  # keys required
        ({**LOCAL, **KEYED}, (), False, False),  # some tenant has keys
    ],
)
def test_admin_is_open_only_in_key_less_local_mode(
    tenants: dict[str, TenantSettings], admin_keys: tuple[str, ...], require_api_key: bool, open_: bool
) -> None:
    check = policy(tenants, admin_keys, require_api_key)
    assert (refusal(check, ADMIN, None) is None) is open_


def test_inference_needs_a_tenant() -> None:
    assert refusal(policy(KEYED), INFER, None) is Unauthenticated
    assert refusal(policy(KEYED), INFER, "gold-key") is None
    assert refusal(policy(KEYED), INFER, "nope") is Unauthenticated
    assert refusal(policy(LOCAL), INFER, None) is None  # the anonymous tenant
    assert refusal(policy(LOCAL), INFER, "nope") is Unauthenticated  # a wrong key is never anonymous


def test_the_directory_is_read_per_call() -> None:
    directories = [TenantDirectory(LOCAL)]
    check = AccessPolicy(TenantKeys(lambda: directories[-1]), admin_keys=[], require_api_key=False)
    assert refusal(check, ADMIN, None) is None
    directories.append(TenantDirectory({**LOCAL, **KEYED}))  # an etcd override added keys
    assert refusal(check, ADMIN, None) is Unauthenticated


class CountingDirectory:
    """A real directory, counting the authentications it does (each one hashes the key); a wrapper, as the
    compiled core's classes take no interpreted subclasses."""

    hashed = 0

    def __init__(self, tenants: Mapping[str, TenantSettings]) -> None:
        self._directory = TenantDirectory(tenants)

    def authenticate(self, api_key: str | None) -> Tenant:
        CountingDirectory.hashed += 1
        return self._directory.authenticate(api_key)

    def get(self, name: str) -> Tenant | None:
        return self._directory.get(name)

    def names(self) -> list[str]:
        return self._directory.names()


def test_a_key_is_authenticated_once_per_directory_and_a_new_directory_revokes_at_once() -> None:
    CountingDirectory.hashed = 0
    directories = [CountingDirectory(KEYED)]
    keys = TenantKeys(lambda: directories[-1])
    assert {keys.authenticate("gold-key").name for _ in range(100)} == {"gold"}
    assert CountingDirectory.hashed == 1
    directories.append(CountingDirectory({"ops": KEYED["ops"]}))  # gold's key revoked
    with pytest.raises(Unauthenticated):
        keys.authenticate("gold-key")
    assert keys.authenticate("ops-key").name == "ops"


def test_unknown_keys_are_not_remembered_and_the_memory_is_bounded() -> None:
    CountingDirectory.hashed = 0
    directory = CountingDirectory(
        {f"t{i}": TenantSettings(api_keys=[hash_api_key(f"k{i}")]) for i in range(9)}
    )
    keys = TenantKeys(lambda: directory, max_keys=4)
    for _ in range(3):
        with pytest.raises(Unauthenticated):
            keys.authenticate("nope")
    assert CountingDirectory.hashed == 3  # a refused key is checked every time, never kept
    for i in range(9):
        assert keys.authenticate(f"k{i}").name == f"t{i}"
        assert keys.remembered <= 4
