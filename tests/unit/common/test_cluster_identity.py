"""Certificate identities (common/cluster_identity.py) with the development CA: a router proves its role
to an operator tool by signing a challenge with its router certificate's key; a worker's, an operator's,
or another CA's certificate does not pass, nor a signature of another transcript."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from cryptography import x509

from sluice_inference.common.cluster_identity import (
    WORKER_DOMAIN,
    CertificateSigner,
    check_router_certificate,
    worker_tls_name,
)
from sluice_inference.common.cluster_proof import IdentityNotProven
from sluice_inference.common.dev_certs import (
    has_dev_certs,
    issue_worker_certificate,
    worker_certificate_paths,
    write_dev_certs,
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    write_dev_certs(folder, ("w-3",))
    return folder


def test_each_worker_certificate_names_its_own_id(certs: Path) -> None:
    cert_path, key_path = worker_certificate_paths(certs, "w-3")
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"w-3.{WORKER_DOMAIN}" in names.get_values_for_type(x509.DNSName)
    assert f"w-4.{WORKER_DOMAIN}" not in names.get_values_for_type(x509.DNSName)
    assert key_path.stat().st_mode & 0o777 == 0o600
    issue_worker_certificate(certs, "w-4")  # later, from the same CA
    assert worker_certificate_paths(certs, "w-4")[0].exists()
    assert has_dev_certs(certs)


@pytest.mark.parametrize("bad", ["W-3", "w_3", "w/3", "", "-w", "a" * 64])
def test_ids_no_certificate_can_name_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="cannot be named by a certificate"):
        worker_tls_name(bad)


def test_a_router_certificate_signature_proves_the_router_role(certs: Path, tmp_path: Path) -> None:
    # Read when the test runs, not at import: the certificates are valid from 5 minutes before they are
    # made, and a full suite collects this module long before it runs it.
    now = datetime.datetime.now(datetime.UTC)
    ca = (certs / "ca.pem").read_bytes()
    transcript = b"a challenge's server transcript"
    router = CertificateSigner(certs / "router-client.pem", certs / "router-client-key.pem")
    check_router_certificate(router.certificate, router.sign(transcript), transcript, ca, now)
    with pytest.raises(IdentityNotProven, match="signature"):
        check_router_certificate(router.certificate, router.sign(b"another"), transcript, ca, now)
    admin = CertificateSigner(certs / "admin-client.pem", certs / "admin-client-key.pem")
    with pytest.raises(IdentityNotProven, match="not a router's"):
        check_router_certificate(admin.certificate, admin.sign(transcript), transcript, ca, now)
    worker = CertificateSigner(*worker_certificate_paths(certs, "w-3"))
    with pytest.raises(IdentityNotProven, match="not one of this cluster's"):  # a server certificate
        check_router_certificate(worker.certificate, worker.sign(transcript), transcript, ca, now)
    write_dev_certs(tmp_path)
    stranger = CertificateSigner(tmp_path / "router-client.pem", tmp_path / "router-client-key.pem")
    with pytest.raises(IdentityNotProven, match="not one of this cluster's"):
        check_router_certificate(stranger.certificate, stranger.sign(transcript), transcript, ca, now)
    with pytest.raises(IdentityNotProven, match="no router certificate"):
        check_router_certificate(b"", b"", transcript, ca, now)
