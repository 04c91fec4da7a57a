"""Security settings in common/trust_settings.py and common/cluster_auth.py: secrets from files, pairs that go
together, keys named in errors, secrets never in a repr, which tokens a worker's proofs accept."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from sluice_inference.common.cluster_auth import require_worker_credentials
from sluice_inference.common.cluster_proof import (
    IdentityNotProven,
    ProofIssuer,
    check_answer,
    derive_key,
    new_nonce,
)
from sluice_inference.common.config import ConfigError, SluiceConfig, load_config
from sluice_inference.common.tls import read_pem
from sluice_inference.common.trust_settings import ClusterSettings

TOKEN = "a-cluster-token-of-enough-length"


def test_token_file_is_read_and_kept_out_of_reprs(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    config = load_config(environ={"SLUICE_CLUSTER__TOKEN_FILE": str(path)})
    assert config.cluster.token_value() == TOKEN
    assert config.cluster.accepted() == [TOKEN]
    assert TOKEN not in repr(config) and TOKEN not in str(config.model_dump())
    # a nested settings object is validated again inside SluiceConfig: still one secret, not two
    assert SluiceConfig(cluster=config.cluster).cluster.token_value() == TOKEN


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"SLUICE_CLUSTER__TOKEN_FILE": "/no/such/file"}, "token_file"),
        ({"SLUICE_CLUSTER__TOKEN": "short"}, "at least 16"),
        ({"SLUICE_CLUSTER__TOKEN": TOKEN, "SLUICE_CLUSTER__TOKEN_FILE": "/x"}, "not both"),
        ({"SLUICE_CLUSTER__CA_FILE": "/ca.pem"}, "all three"),
        ({"SLUICE_ETCD__USERNAME": "root"}, "go together"),
        ({"SLUICE_ETCD__CERT_FILE": "/c.pem"}, "cert_file and key_file"),
        ({"SLUICE_REDIS__URL": "redis://r:6379/0", "SLUICE_REDIS__CA_FILE": "/ca.pem"}, "rediss://"),
        ({"SLUICE_REDIS__URL": "redis://:pw@r:6379/0"}, "not in the URL"),
        ({"SLUICE_ROUTER__TLS__REQUIRE_CLIENT_CERT": "true"}, "need cert_file"),
        ({"SLUICE_ROUTER__ADMIN_KEYS": '["plain-text-key"]'}, "router.admin_keys"),
    ],
)
def test_bad_security_settings_name_the_key(environ: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(environ=environ)
    assert named in str(caught.value)
    assert "pw" not in str(caught.value) or named == "not in the URL"


def test_a_worker_needs_tls_or_a_token() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.token"):
        require_worker_credentials(ClusterSettings(), "w-1")
    require_worker_credentials(ClusterSettings(token=SecretStr(TOKEN)), "w-1")


def test_a_worker_proves_every_configured_token_and_nothing_else() -> None:
    settings = ClusterSettings(token=SecretStr(TOKEN), accepted_tokens=[SecretStr("the-previous-token-xx")])
    issuer = ProofIssuer(settings.accepted())
    nonce = new_nonce()
    answer = issuer.answer("workers/w-1", "admin", nonce, 0.0)
    for token in (TOKEN, "the-previous-token-xx"):
        check_answer(
            derive_key(token), caller="admin", expected="workers/w-1", caller_nonce=nonce, answer=answer
        )
    with pytest.raises(IdentityNotProven):
        check_answer(
            derive_key(TOKEN[:-1]), caller="admin", expected="workers/w-1", caller_nonce=nonce, answer=answer
        )
    assert not ProofIssuer([]).enabled


def test_unreadable_certificates_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cluster\.ca_file: cannot read"):
        read_pem(tmp_path / "missing.pem", "cluster.ca_file")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="not a PEM file"):
        read_pem(tmp_path / "junk.pem", "router.tls.cert_file")
