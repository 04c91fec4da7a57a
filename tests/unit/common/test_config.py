"""Config: file < environment < flags, and bad values name their key."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_inference.common.config import ConfigError, load_config


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


HMAC_KEY = "a-redis-hmac-key-of-at-least-32-chars"


def test_redis_without_an_hmac_key_is_refused_naming_the_key() -> None:
    """Anyone who can write to Redis could plant results in an unkeyed store: a shared Redis needs the key."""
    with pytest.raises(ConfigError, match=r"redis\.hmac_key"):
        load_config(environ={"SLUICE_REDIS__URL": "redis://r:6379/0"})
    assert load_config(environ={}).redis.hmac_keys() == []  # key-less local mode: in-process stores


def test_the_redis_hmac_key_comes_from_a_file_and_stays_out_of_reprs(tmp_path: Path) -> None:
    path = tmp_path / "hmac-key"
    path.write_text(HMAC_KEY + "\n")
    environ = {"SLUICE_REDIS__URL": "redis://r:6379/0", "SLUICE_REDIS__HMAC_KEY_FILE": str(path)}
    config = load_config(environ=environ)
    assert config.redis.hmac_keys() == [HMAC_KEY.encode()]
    assert HMAC_KEY not in repr(config) and HMAC_KEY not in str(config.model_dump())
    rotating = load_config(environ={**environ, "SLUICE_REDIS__ACCEPTED_HMAC_KEYS": f'["{"o" * 32}"]'})
    assert rotating.redis.hmac_keys() == [HMAC_KEY.encode(), b"o" * 32]  # writes with the first


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"SLUICE_REDIS__HMAC_KEY": "short"}, "at least 32"),
        ({"SLUICE_REDIS__HMAC_KEY": HMAC_KEY, "SLUICE_REDIS__HMAC_KEY_FILE": "/x"}, "not both"),
        ({"SLUICE_REDIS__HMAC_KEY_FILE": "/no/such/file"}, "hmac_key_file"),
    ],
)
def test_bad_redis_hmac_keys_name_the_key(environ: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(environ={"SLUICE_REDIS__URL": "redis://r:6379/0", **environ})
    assert named in str(caught.value) and HMAC_KEY not in str(caught.value)
