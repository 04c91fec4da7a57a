"""Tenant authentication, authorization and priority entitlement."""

from __future__ import annotations

import pytest

from sluice_inference.common.errors import Code, SluiceError
from sluice_inference.common.serving_settings import TenantSettings
from sluice_inference.router.policy.tenants import (
    MAX_REMEMBERED_MODELS,
    Tenant,
    TenantDirectory,
    hash_api_key,
)

GOLD = TenantSettings(
    api_keys=[hash_api_key("gold-key")], models=["mlp", "enc*"], default_priority=2, max_priority=1
)
BRONZE = TenantSettings(api_keys=[hash_api_key("bronze-key")], default_priority=3, max_priority=2)


def code_of(call: object) -> Code:
    with pytest.raises(SluiceError) as caught:
        call()  # type: ignore[operator]
    return caught.value.code


def test_keys_map_to_tenants_and_unknown_keys_are_unauthenticated() -> None:
    directory = TenantDirectory({"gold": GOLD, "anonymous": TenantSettings()})
    assert directory.authenticate("gold-key").name == "gold"
    assert code_of(lambda: directory.authenticate("stolen")) == Code.UNAUTHENTICATED


def test_keyless_requests_need_an_anonymous_tenant() -> None:
    assert TenantDirectory({"anonymous": TenantSettings()}).authenticate(None).name == "anonymous"
    assert code_of(lambda: TenantDirectory({"gold": GOLD}).authenticate(None)) == Code.UNAUTHENTICATED
    strict = TenantDirectory({"anonymous": TenantSettings()}, require_api_key=True)
    assert code_of(lambda: strict.authenticate(None)) == Code.UNAUTHENTICATED


def test_models_outside_the_globs_are_permission_denied() -> None:
    gold = TenantDirectory({"gold": GOLD}).authenticate("gold-key")
    TenantDirectory.authorize(gold, "encoder")
    assert code_of(lambda: TenantDirectory.authorize(gold, "synthetic")) == Code.PERMISSION_DENIED


def test_priority_defaults_and_is_capped_not_rejected() -> None:
    bronze = TenantDirectory({"bronze": BRONZE}).authenticate("bronze-key")
    assert bronze.priority(0, 10) == 3
    assert bronze.priority(1, 10) == 2  # asked above its entitlement: capped
    assert bronze.priority(5, 10) == 5


def test_config_rejects_raw_keys_and_inverted_priorities() -> None:
    with pytest.raises(ValueError, match="sha256"):
        TenantSettings(api_keys=["plain-text-key"])
    with pytest.raises(ValueError, match="default_priority"):
        TenantSettings(default_priority=1, max_priority=2)


def test_priorities_outside_the_configured_levels_are_invalid_argument() -> None:
    bronze = TenantDirectory({"bronze": BRONZE}).authenticate("bronze-key")
    assert bronze.priority(10, 10) == 10
    for hostile in (11, 12_345, 2**63 - 1, -1):
        assert code_of(lambda p=hostile: bronze.priority(p, 10)) == Code.INVALID_ARGUMENT


def test_a_tenant_is_granted_better_than_its_default_priority_only_explicitly() -> None:
    """With `max_priority` 1 for everyone, any tenant could send priority 1 and evict the others' queued
    priority-2 work."""
    plain = Tenant("plain", TenantSettings())
    assert plain.priority(1, 10) == plain.priority(0, 10) == 2
    low = Tenant("low", TenantSettings(default_priority=5))
    assert low.priority(1, 10) == 5 and low.priority(7, 10) == 7
    granted = Tenant("gold", TenantSettings(default_priority=2, max_priority=1))
    assert granted.priority(1, 10) == 1 and granted.priority(0, 10) == 2


def test_model_verdicts_are_remembered_within_a_bound_and_follow_the_tenant_settings() -> None:
    gold = Tenant("gold", GOLD)
    names = [f"enc{i}" for i in range(MAX_REMEMBERED_MODELS + 10)]
    assert all(gold.allows(name) for name in names)  # past the bound it starts over, still right
    assert not gold.allows("synthetic") and not gold.allows("synthetic")
    narrowed = Tenant("gold", GOLD.model_copy(update={"models": ["mlp"]}))  # a reload builds a new tenant
    assert narrowed.allows("mlp") and not narrowed.allows("enc0")
