"""A development CA and the certificates a local cluster needs: written by `sluice certs dev DIR`, by the
local cluster launcher for `sluice up --tls` (common/local_cluster.py), and by tests. Not for production
(docs/security.md says what to use there).

One CA signs everything. Certificates name the identity they prove (common/cluster_identity.py): each
worker gets its own, naming `<worker-id>.worker.sluice` (`issue_worker_certificate`, under `workers/`),
so a router can tell the worker a record claims from any other holder of a cluster certificate; router
clients name `router.sluice`, operator tools `admin.sluice`. Extended key usages keep serving and calling
apart: a worker's certificate (`serverAuth`) cannot call another worker. Keys are ECDSA P-256, written
0600; certificates live 30 days.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sluice_inference.common.cluster_identity import ADMIN_NAME, ROUTER_NAME, worker_tls_name

VALID_DAYS = 30
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
WORKERS_FOLDER = "workers"


@dataclass(frozen=True)
class Leaf:
    """One certificate to issue: its file stem, names and whether it serves or calls."""

    stem: str
    names: tuple[str, ...]
    server: bool


LEAVES = (
    Leaf("router", LOCAL_NAMES, server=True),  # the client port
    Leaf("etcd", LOCAL_NAMES, server=True),
    Leaf("router-client", (ROUTER_NAME,), server=False),  # routers dialling workers
    Leaf("admin-client", (ADMIN_NAME,), server=False),  # `sluice drain` and other operator tools
)
"""Worker certificates are per worker id: `issue_worker_certificate`."""


_CA_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    path.chmod(0o600)  # an existing file keeps its old mode through O_CREAT


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _san(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _builder(
    subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _issue(
    directory: Path, stem: str, leaf: Leaf, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    key = _key()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if leaf.server else ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (
        _builder(f"sluice {leaf.stem}", ca.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(_san(leaf.names), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
    _write_cert(cert_path, cert)
    _write_key(key_path, key)
    return cert_path, key_path


def write_dev_certs(directory: Path, worker_ids: tuple[str, ...] = ()) -> list[Path]:
    """Write ca.pem (+ ca-key.pem), `<stem>.pem` / `<stem>-key.pem` for each of `LEAVES`, and a
    certificate for each of `worker_ids`; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Sluice development CA")])
    ca = (
        _builder("Sluice development CA", ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    written = [directory / "ca.pem", directory / "ca-key.pem"]
    _write_cert(written[0], ca)
    _write_key(written[1], ca_key)
    for leaf in LEAVES:
        written += _issue(directory, leaf.stem, leaf, ca, ca_key)
    for worker_id in worker_ids:
        written += issue_worker_certificate(directory, worker_id)
    return written


def worker_certificate_paths(directory: Path, worker_id: str) -> tuple[Path, Path]:
    """Where `issue_worker_certificate` writes a worker's certificate and key."""
    folder = directory / WORKERS_FOLDER
    return folder / f"{worker_id}.pem", folder / f"{worker_id}-key.pem"


def issue_worker_certificate(directory: Path, worker_id: str) -> tuple[Path, Path]:
    """Issue, with the CA in `directory`, the certificate of one worker: it names
    `<worker_id>.worker.sluice` (and the local names, for `sluice health --tls`). Returns the certificate
    and key paths (`workers/<worker_id>.pem`, `workers/<worker_id>-key.pem`)."""
    name = worker_tls_name(worker_id)  # ValueError for an id no certificate can name
    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / 'ca-key.pem'}: not the development CA's key")
    folder = directory / WORKERS_FOLDER
    folder.mkdir(exist_ok=True)
    return _issue(
        folder, worker_id, Leaf(f"worker {worker_id}", (name, *LOCAL_NAMES), server=True), ca, ca_key
    )


def has_dev_certs(directory: Path) -> bool:
    """Whether `directory` already holds a full set of this layout (so `sluice up --tls --certs DIR`
    reuses it); a set from before per-worker certificates (router clients naming `sluice-router`) is not."""
    stems = ["ca", *(leaf.stem for leaf in LEAVES)]
    if not all((directory / f"{stem}.pem").exists() for stem in stems):
        return False
    client = x509.load_pem_x509_certificate((directory / "router-client.pem").read_bytes())
    try:
        names = client.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return ROUTER_NAME in names.get_values_for_type(x509.DNSName)
