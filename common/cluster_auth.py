"""Credentials of the router → worker hop (DESIGN.md §9), for both ends.

- mTLS: one cluster CA. Routers (and `sluice drain`) present a client certificate it signed and accept
  only worker certificates it signed; workers require a client certificate it signed.
- Token: where TLS is off, routers send the shared token in the `sluice-cluster-token` metadata of every
  call; workers compare digests in constant time against every accepted token (two during a rotation).
Every credential configured is used: with both, a worker requires both.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import grpc

from common.config import ClusterSettings, ConfigError
from common.tls import channel_credentials, server_credentials

TOKEN_HEADER = "sluice-cluster-token"
PLACEHOLDER_PREFIX = "REPLACE-ME"
"""deploy/base/cluster-token.env ships a token starting with this: a worker refuses to run with it."""


class ClusterClient:
    """The calling end (a router, or the CLI): how to dial a worker. PEM files are read once, here."""

    def __init__(self, settings: ClusterSettings) -> None:
        self._credentials: grpc.ChannelCredentials | None = None
        if settings.tls:
            self._credentials = channel_credentials(
                ca_file=settings.ca_file,
                cert_file=settings.cert_file,
                key_file=settings.key_file,
                section="cluster",
            )
        self._server_name = settings.server_name
        self.max_message_bytes = settings.max_message_bytes
        """The message limit both ends of the hop agree on."""
        token = settings.token_value()
        self.metadata: tuple[tuple[str, str], ...] = () if token is None else ((TOKEN_HEADER, token),)
        """Metadata to send on every call to a worker."""

    def channel(self, addr: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A channel to a worker: TLS with the cluster credentials, else plaintext (token only)."""
        if self._credentials is None:
            return grpc.aio.insecure_channel(addr, options=list(options))
        extra = [] if self._server_name is None else [("grpc.ssl_target_name_override", self._server_name)]
        return grpc.aio.secure_channel(addr, self._credentials, options=[*options, *extra])


def worker_server_credentials(settings: ClusterSettings) -> grpc.ServerCredentials | None:
    """A worker's TLS credentials requiring a client certificate from the cluster CA; None without TLS."""
    if not settings.tls:
        return None
    assert settings.cert_file is not None and settings.key_file is not None
    return server_credentials(
        cert_file=settings.cert_file,
        key_file=settings.key_file,
        client_ca_file=settings.ca_file,
        require_client_cert=True,
        section="cluster",
    )


def require_worker_credentials(settings: ClusterSettings) -> None:
    """ConfigError unless the worker can attribute a batch to a router: TLS, a token, or both."""
    if not settings.tls and not settings.accepted():
        raise ConfigError(
            "cluster: a worker needs mTLS (cluster.cert_file, key_file, ca_file) or a shared token "
            "(cluster.token or cluster.token_file) so it runs only batches from routers; "
            "`sluice up` makes one per run (docs/security.md)"
        )
    if any(token.startswith(PLACEHOLDER_PREFIX) for token in settings.accepted()):
        raise ConfigError(
            "cluster.token: still the placeholder from deploy/base/cluster-token.env; "
            "set a random one (openssl rand -hex 32)"
        )


class TokenCheck:
    """Whether a presented token is one of the accepted ones. Only SHA-256 digests are kept and compared
    (constant time, every candidate), so neither length nor prefix of a token leaks through timing."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    @property
    def enabled(self) -> bool:
        """Whether any token is configured (else there is nothing to check)."""
        return bool(self._digests)

    def allows(self, presented: str | None) -> bool:
        """True when `presented` matches an accepted token."""
        if presented is None:
            return False
        digest = hashlib.sha256(presented.encode()).digest()
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(known, digest)
        return matched
