"""Who a cluster certificate says its holder is (mTLS on the router ↔ worker hop; docs/security.md).

Names are DNS SANs, the names gRPC's own TLS check reads:
- a worker: `<worker-id>.worker.sluice` — one certificate per worker id. A router dialling the address in
  `workers/<id>` makes gRPC check the server certificate names `<id>.worker.sluice`, so a certificate
  issued to `w-3` cannot serve as `w-4`, nor a router's as a worker's;
- a router: `router.sluice` (routers are interchangeable: the role is what matters to a worker and to
  an operator's admin key);
- an operator tool (`sluice drain`): `admin.sluice`.
Never issue wildcards under `worker.sluice`: `*.worker.sluice` would serve as every worker.

A router also proves its role to operator tools that found it in `routers/`: it signs the server
transcript of a challenge (common/cluster_proof.py) with the key of its cluster certificate, and the
tool checks the certificate chains to the cluster CA and names `router.sluice`.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from sluice_inference.common.cluster_proof import IdentityNotProven
from sluice_inference.common.tls import read_pem

WORKER_DOMAIN = "worker.sluice"
ROUTER_NAME = "router.sluice"
ADMIN_NAME = "admin.sluice"
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
MAX_CERTIFICATE_BYTES = 16 * 1024
"""Largest certificate (PEM chain) a router may send as its proof."""


def worker_tls_name(worker_id: str) -> str:
    """The DNS name a worker's certificate must carry; ValueError when the id cannot be one (under mTLS a
    worker id is lower-case letters, digits, '-' and '.', each dot-separated part a DNS label)."""
    if len(worker_id) > 200 or not all(_LABEL.fullmatch(part) for part in worker_id.split(".")):
        raise ValueError(
            f"worker id {worker_id[:64]!r} cannot be named by a certificate: under mTLS use lower-case "
            "letters, digits, '-' and '.' (a DNS name)"
        )
    return f"{worker_id}.{WORKER_DOMAIN}"


def peer_names(auth_context: Mapping[str, Sequence[bytes]]) -> set[str]:
    """The SANs of the peer's certificate, as a grpc server's `context.auth_context()` gives them (empty
    without TLS or a client certificate)."""
    return {n.decode(errors="replace") for n in auth_context.get("x509_subject_alternative_name", ())}


class CertificateSigner:
    """A router's cluster certificate and key (read once): signs a challenge's server transcript."""

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.certificate = read_pem(cert_file, "cluster.cert_file")
        key = serialization.load_pem_private_key(read_pem(key_file, "cluster.key_file"), password=None)
        self._key: Any = key

    def sign(self, transcript: bytes) -> bytes:
        """The signature of `transcript` with the certificate's key."""
        key = self._key
        if isinstance(key, ec.EllipticCurvePrivateKey):
            return bytes(key.sign(transcript, ec.ECDSA(hashes.SHA256())))
        if isinstance(key, rsa.RSAPrivateKey):
            return bytes(key.sign(transcript, padding.PKCS1v15(), hashes.SHA256()))
        if isinstance(key, ed25519.Ed25519PrivateKey):
            return bytes(key.sign(transcript))
        raise ValueError(f"cluster.key_file: unsupported key type {type(key).__name__}")


def check_router_certificate(
    certificate: bytes, signature: bytes, transcript: bytes, ca_bundle: bytes, now: datetime.datetime
) -> None:
    """IdentityNotProven unless `certificate` (PEM, leaf first) chains to a CA of `ca_bundle` as a
    client certificate, names `router.sluice`, and its key signed `transcript`."""
    if not certificate or len(certificate) > MAX_CERTIFICATE_BYTES:
        raise IdentityNotProven("no router certificate in its answer")
    try:
        chain = x509.load_pem_x509_certificates(certificate)
        store = Store(x509.load_pem_x509_certificates(ca_bundle))
        verifier = PolicyBuilder().store(store).time(now).build_client_verifier()
        verifier.verify(chain[0], chain[1:])
    except (ValueError, VerificationError) as exc:
        raise IdentityNotProven(f"its certificate is not one of this cluster's: {exc}") from None
    leaf = chain[0]
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = x509.SubjectAlternativeName([])
    if ROUTER_NAME not in names.get_values_for_type(x509.DNSName):
        raise IdentityNotProven(f"its certificate does not name {ROUTER_NAME!r} (not a router's)")
    try:
        _verify(leaf.public_key(), signature, transcript)
    except (InvalidSignature, ValueError):
        raise IdentityNotProven("its signature does not match its certificate") from None


def _verify(public_key: Any, signature: bytes, transcript: bytes) -> None:
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        public_key.verify(signature, transcript, ec.ECDSA(hashes.SHA256()))
    elif isinstance(public_key, rsa.RSAPublicKey):
        public_key.verify(signature, transcript, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(public_key, ed25519.Ed25519PublicKey):
        public_key.verify(signature, transcript)
    else:
        raise ValueError("unsupported key type")
