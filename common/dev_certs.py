"""A development CA and the certificates a local cluster needs: written by `sluice certs dev DIR`, by the
local cluster launcher for `sluice up --tls` (common/local_cluster.py), and by tests. Not for production
(docs/security.md says what to use there).

One CA signs everything. Extended key usages keep the roles apart where it matters: workers accept only
client certificates (`clientAuth`: router-client, admin-client), so a worker's own server certificate
cannot be used to call another worker. Keys are ECDSA P-256, written 0600; certificates live 30 days.
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

VALID_DAYS = 30
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
WORKER_NAME = "sluice-worker"
"""A DNS name every worker certificate carries, for `cluster.server_name` where addresses are pod IPs."""


@dataclass(frozen=True)
class Leaf:
    """One certificate to issue: its file stem, names and whether it serves or calls."""

    stem: str
    names: tuple[str, ...]
    server: bool


LEAVES = (
    Leaf("router", LOCAL_NAMES, server=True),  # the client port
    Leaf("worker", (*LOCAL_NAMES, WORKER_NAME), server=True),  # the worker stream port
    Leaf("etcd", LOCAL_NAMES, server=True),
    Leaf("router-client", ("sluice-router",), server=False),  # routers dialling workers
    Leaf("admin-client", ("sluice-admin",), server=False),  # `sluice drain` and other operator tools
)


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


def write_dev_certs(directory: Path) -> list[Path]:
    """Write ca.pem (+ ca-key.pem) and `<stem>.pem` / `<stem>-key.pem` for each of `LEAVES`; return the
    paths written."""
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
        key = _key()
        usage = ExtendedKeyUsageOID.SERVER_AUTH if leaf.server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            _builder(f"sluice {leaf.stem}", ca_name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(_san(leaf.names), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = directory / f"{leaf.stem}.pem", directory / f"{leaf.stem}-key.pem"
        _write_cert(cert_path, cert)
        _write_key(key_path, key)
        written += [cert_path, key_path]
    return written


def has_dev_certs(directory: Path) -> bool:
    """Whether `directory` already holds a full set (so `sluice up --tls --certs DIR` reuses it)."""
    stems = ["ca", *(leaf.stem for leaf in LEAVES)]
    return all((directory / f"{stem}.pem").exists() for stem in stems)
