"""Config: file < environment < flags, and bad values name their key."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError, load_config


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "sluice.yaml"
    path.write_text("router:\n  listen: 0.0.0.0:9000\n  metrics_port: 9001\netcd:\n  lease_ttl_s: 5\n")
    env = {"SLUICE_ROUTER__METRICS_PORT": "9100", "SLUICE_ETCD__ENDPOINTS": '["10.0.0.1:2379"]'}
    config = load_config(path, overrides={"etcd": {"lease_ttl_s": 7}}, environ=env)
    assert config.router.listen == "0.0.0.0:9000"
    assert config.router.metrics_port == 9100
    assert config.etcd.endpoints == ["10.0.0.1:2379"]
    assert config.etcd.lease_ttl_s == 7


def test_errors_name_the_offending_key(tmp_path: Path) -> None:
    path = tmp_path / "sluice.yaml"
    path.write_text("worker:\n  device: tpu\n  torch_threads: 0\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert "worker.device" in str(caught.value) and "worker.torch_threads" in str(caught.value)


def test_unknown_keys_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"router\.lisen"):
        load_config(overrides={"router": {"lisen": "x"}}, environ={})
