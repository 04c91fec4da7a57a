"""An etcd tenant override can only take away: every field that would grant more than the configured tenant
is held to it (and reported), every tightening applies, and a revocation written together with a forbidden
grant still takes effect."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sluice_inference.common.serving_settings import TenantSettings
from sluice_inference.router.policy.overrides import RULES, bound_override
from sluice_inference.router.policy.tenants import hash_api_key

OLD, NEW, ATTACKER = hash_api_key("old"), hash_api_key("new"), hash_api_key("attacker")
GOLD = TenantSettings(
    api_keys=[OLD, NEW],
    rate=100,
    burst=50,
    max_inflight=20,
    weight=2,
    default_priority=3,
    max_priority=2,
    models=["mlp", "enc*"],
)


def test_every_tenant_field_has_a_rule() -> None:
    """A new TenantSettings field must be given a rule here (or be left out of etcd's reach on purpose)."""
    assert set(RULES) == set(TenantSettings.model_fields)


def test_a_grant_of_admin_is_dropped_and_the_revocation_in_the_same_write_applies() -> None:
    settings, loosened = bound_override(GOLD, {"admin": True, "api_keys": [NEW]})
    assert settings.admin is False
    assert settings.api_keys == [NEW]
    assert loosened == ["admin"]


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"api_keys": [OLD, ATTACKER]}, "api_keys"),
        ({"rate": 1e9}, "rate"),
        ({"burst": 10**6}, "burst"),
        ({"max_inflight": 10**6}, "max_inflight"),
        ({"weight": 100}, "weight"),
        ({"max_priority": 1}, "max_priority"),
        ({"models": ["*"]}, "models"),
        ({"models": ["secret"]}, "models"),
        ({"models": ["mlp*"]}, "models"),  # a glob wider than any listed
        ({"admin": True}, "admin"),
    ],
)
def test_every_loosening_is_held_to_the_configuration(patch: dict[str, object], field: str) -> None:
    settings, loosened = bound_override(GOLD, {**patch, "rate": 10} if field != "rate" else patch)
    assert loosened == [field]
    held = getattr(settings, field)
    if field == "api_keys":
        assert held == [OLD]  # the unknown key is dropped, the listed one kept
    elif field == "models":
        assert all(pattern in GOLD.models for pattern in held)
    else:
        assert held == getattr(GOLD, field)
    if field != "rate":
        assert settings.rate == 10  # the tightening written beside it applies


def test_default_priority_better_than_configured_is_held() -> None:
    settings, loosened = bound_override(GOLD, {"default_priority": 2})
    assert settings.default_priority == 3 and loosened == ["default_priority"]


def test_every_tightening_applies() -> None:
    patch = {
        "api_keys": [],
        "rate": 1,
        "burst": 1,
        "max_inflight": 1,
        "weight": 0.5,
        "default_priority": 9,
        "max_priority": 5,
        "models": ["mlp", "encoder"],
        "admin": False,
    }
    settings, loosened = bound_override(GOLD, patch)
    assert loosened == []
    assert settings.model_dump() == {**GOLD.model_dump(), **patch}


def test_a_worse_max_priority_drags_the_default_with_it() -> None:
    settings, loosened = bound_override(GOLD, {"max_priority": 5})
    assert (settings.default_priority, settings.max_priority, loosened) == (5, 5, [])


def test_an_admin_tenant_may_lose_the_role() -> None:
    admin = GOLD.model_copy(update={"admin": True})
    assert bound_override(admin, {"admin": False})[0].admin is False
    assert bound_override(admin, {})[0].admin is True


def test_star_in_the_configuration_allows_any_pattern() -> None:
    anything = GOLD.model_copy(update={"models": ["*"]})
    assert bound_override(anything, {"models": ["mlp*", "x"]}) == (
        anything.model_copy(update={"models": ["mlp*", "x"]}),
        [],
    )


@pytest.mark.parametrize(
    "patch",
    [
        {"rate": 0},
        {"rate": "fast"},
        {"root": True},
        {"api_keys": ["plain-text-key"]},
        {"default_priority": 1},
    ],
)
def test_a_malformed_override_raises(patch: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        bound_override(GOLD, patch)
