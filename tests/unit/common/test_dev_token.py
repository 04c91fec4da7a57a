"""The published development token is accepted only in development mode, and `sluice worker --dev` is
what turns that mode on."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from sluice_inference.cli.main import _build_parser, _overrides
from sluice_inference.common.config import ConfigError, load_config
from sluice_inference.common.dev_token import DEV_CLUSTER_TOKEN, refuse_dev_token
from sluice_inference.common.trust_settings import ClusterSettings
from tests.deploy.rendering import DEPLOY


def test_the_constant_is_the_token_the_dev_overlay_publishes() -> None:
    lines = (DEPLOY / "overlays" / "dev" / "cluster-token.env").read_text().splitlines()
    assert f"SLUICE_CLUSTER__TOKEN={DEV_CLUSTER_TOKEN}" in lines


@pytest.mark.parametrize(
    "cluster",
    [
        ClusterSettings(token=SecretStr(DEV_CLUSTER_TOKEN)),
        ClusterSettings(token=SecretStr("a" * 32), accepted_tokens=[SecretStr(DEV_CLUSTER_TOKEN)]),
    ],
)
def test_outside_dev_mode_the_published_token_is_refused(cluster: ClusterSettings) -> None:
    with pytest.raises(ConfigError, match="--dev"):
        refuse_dev_token(cluster, dev=False)
    refuse_dev_token(cluster, dev=True)


def test_a_private_token_needs_no_dev_mode() -> None:
    refuse_dev_token(ClusterSettings(token=SecretStr("b" * 32)), dev=False)


def test_dev_mode_comes_from_the_flag_or_the_config() -> None:
    def dev(argv: list[str], environ: dict[str, str]) -> bool:
        args = _build_parser().parse_args(argv)
        return load_config(overrides=_overrides(args), environ=environ).worker.dev

    assert dev(["worker", "--dev"], {}) is True
    assert dev(["worker"], {}) is False
    assert dev(["worker"], {"SLUICE_WORKER__DEV": "true"}) is True  # a flag left out overrides nothing
