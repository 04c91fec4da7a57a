"""Credentials of the router → worker hop (docs/design.md §9), for both ends, and the identity proof coming
before any secret is sent to an address read from etcd (docs/security.md, "Router → worker").

- mTLS: one cluster CA. A caller dialling the address in `workers/<id>` makes gRPC check that the
  worker's certificate names `<id>.worker.sluice` (common/cluster_identity.py); workers require a client
  certificate from the CA naming a router (streams) or a router or an operator tool (admin calls).
- Token: the token itself never leaves the process. A caller first asks `ClusterIdentity/Challenge`, checks
  the server's proof (common/cluster_proof.py), and only then makes its call, with its own proof in the
  metadata; the worker checks that proof before the request is read.
Every credential configured is used: with both, a worker requires both and a caller checks both.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import grpc

from sluice_inference.common.clock import Clock
from sluice_inference.common.cluster_identity import (
    CertificateSigner,
    check_router_certificate,
    worker_tls_name,
)
from sluice_inference.common.cluster_proof import (
    Answer,
    CallerClaim,
    IdentityNotProven,
    ProofIssuer,
    caller_proof,
    check_answer,
    derive_key,
    new_nonce,
    server_transcript,
)
from sluice_inference.common.config import ConfigError
from sluice_inference.common.errors import Unauthenticated
from sluice_inference.common.etcd import ROUTERS, WORKERS
from sluice_inference.common.grpc_errors import abort
from sluice_inference.common.pb.sluice.v1 import worker_pb2, worker_pb2_grpc
from sluice_inference.common.tls import channel_credentials, read_pem, server_credentials
from sluice_inference.common.trust_settings import ClusterSettings

CALLER_HEADER = "sluice-cluster-caller"
NONCE_HEADER = "sluice-cluster-nonce-bin"
COOKIE_HEADER = "sluice-cluster-cookie-bin"
PROOF_HEADER = "sluice-cluster-proof-bin"
STREAM_METHOD = "/sluice.v1.Worker/Stream"
DRAIN_METHOD = "/sluice.v1.WorkerAdmin/Drain"
STATUS_METHOD = "/sluice.v1.WorkerAdmin/Status"
CHALLENGE_TIMEOUT_S = 5.0
ADMIN_CALLER = "admin"
"""The `caller` of operator tools (`sluice drain`, `sluice cache`); routers are `routers/<id>`."""
PLACEHOLDER_PREFIX = "REPLACE-ME"
"""deploy/base/cluster-token.env ships a token starting with this: a worker refuses to run with it."""

Metadata: TypeAlias = tuple[tuple[str, str | bytes], ...]


def worker_identity(worker_id: str) -> str:
    """The identity a worker proves: its etcd key without the prefix."""
    return WORKERS + worker_id


def router_identity(router_id: str) -> str:
    """The identity a router proves: its etcd key without the prefix."""
    return ROUTERS + router_id


async def challenge(channel: grpc.aio.Channel, caller: str) -> tuple[bytes, worker_pb2.IdentityProof]:
    """Step 1 on `channel`: our fresh nonce and the server's answer (gRPC errors propagate)."""
    nonce = new_nonce()
    stub = worker_pb2_grpc.ClusterIdentityStub(channel)
    request = worker_pb2.IdentityChallenge(caller=caller, nonce=nonce)
    return nonce, await stub.Challenge(request, timeout=CHALLENGE_TIMEOUT_S)


def _answer(reply: worker_pb2.IdentityProof) -> Answer:
    return Answer(reply.identity, reply.nonce, tuple(reply.token_proofs))


class ClusterClient:
    """The calling end (a router, or the CLI): how to dial a worker and prove who calls, only once the
    worker proved it is the one its record claims. PEM files are read and the token's key derived once,
    here."""

    def __init__(self, settings: ClusterSettings, caller: Callable[[], str] = lambda: ADMIN_CALLER) -> None:
        self._credentials: grpc.ChannelCredentials | None = None
        if settings.tls:
            self._credentials = channel_credentials(
                ca_file=settings.ca_file,
                cert_file=settings.cert_file,
                key_file=settings.key_file,
                section="cluster",
            )
        self._caller = caller
        token = settings.token_value()
        self._key = None if token is None else derive_key(token)  # ~60 ms once, not on the event loop later
        self.max_message_bytes = settings.max_message_bytes
        """The message limit both ends of the hop agree on."""

    def channel(self, addr: str, worker_id: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A channel to the worker `worker_id` at `addr`: TLS that accepts only a certificate naming that
        worker, else plaintext (the token proof is then what authenticates). IdentityNotProven when the
        id is one no certificate can name."""
        if self._credentials is None:
            return grpc.aio.insecure_channel(addr, options=list(options))
        try:
            name = worker_tls_name(worker_id)
        except ValueError as exc:
            raise IdentityNotProven(str(exc)) from None
        return grpc.aio.secure_channel(
            addr, self._credentials, options=[*options, ("grpc.ssl_target_name_override", name)]
        )

    async def authenticate(self, channel: grpc.aio.Channel, worker_id: str, method: str) -> Metadata:
        """The metadata for one call of `method` on `worker_id` (one stream, or one admin call), after the
        worker proved it holds the token and is that worker; IdentityNotProven (nothing was sent but our
        nonce) or a gRPC error otherwise. Under mTLS alone the TLS handshake has proved it: no metadata."""
        key = self._key
        if key is None:
            return ()
        caller, identity = self._caller(), worker_identity(worker_id)
        nonce, reply = await challenge(channel, caller)
        answer = _answer(reply)
        check_answer(key, caller=caller, expected=identity, caller_nonce=nonce, answer=answer)
        proof = caller_proof(
            key,
            caller=caller,
            identity=identity,
            caller_nonce=nonce,
            server_nonce=answer.server_nonce,
            method=method,
        )
        return (
            (CALLER_HEADER, caller),
            (NONCE_HEADER, nonce),
            (COOKIE_HEADER, answer.server_nonce),
            (PROOF_HEADER, proof),
        )


async def prove_router(channel: grpc.aio.Channel, router_id: str, settings: ClusterSettings) -> None:
    """Return once the router at the other end of `channel` proved it is `routers/<router_id>` with every
    cluster credential `settings` holds (the token, and the cluster CA under mTLS); IdentityNotProven (or
    a gRPC error) otherwise. Operator tools call this before sending an admin key to an address from etcd."""
    token, ca_file = settings.token_value(), settings.ca_file
    if token is None and ca_file is None:
        raise IdentityNotProven(
            "this command has no cluster credential to check it with (cluster.token_file, or cluster.ca_file "
            "under mTLS)"
        )
    identity = router_identity(router_id)
    nonce, reply = await challenge(channel, ADMIN_CALLER)
    if token is not None:
        check_answer(
            derive_key(token),
            caller=ADMIN_CALLER,
            expected=identity,
            caller_nonce=nonce,
            answer=_answer(reply),
        )
    if ca_file is not None:
        if reply.identity != identity:
            raise IdentityNotProven(f"it answers as {reply.identity[:256]!r}, not {identity!r}")
        transcript = server_transcript(ADMIN_CALLER, identity, nonce, reply.nonce)
        now = datetime.datetime.now(datetime.UTC)
        ca = read_pem(ca_file, "cluster.ca_file")
        check_router_certificate(reply.certificate, reply.signature, transcript, ca, now)


def caller_claim(metadata: Any) -> CallerClaim | None:
    """The caller's proof in a call's metadata (None when any part is missing)."""
    values: dict[str, str | bytes] = {}
    for key, value in metadata or ():
        if key in (CALLER_HEADER, NONCE_HEADER, COOKIE_HEADER, PROOF_HEADER) and key not in values:
            values[key] = value
    caller, nonce = values.get(CALLER_HEADER), values.get(NONCE_HEADER)
    cookie, proof = values.get(COOKIE_HEADER), values.get(PROOF_HEADER)
    if not isinstance(caller, str) or not all(isinstance(v, bytes) for v in (nonce, cookie, proof)):
        return None
    assert isinstance(nonce, bytes) and isinstance(cookie, bytes) and isinstance(proof, bytes)
    return CallerClaim(caller, nonce, cookie, proof)


class IdentityServicer(worker_pb2_grpc.ClusterIdentityServicer):
    """`sluice.v1.ClusterIdentity`, open to anyone (the proof is the point): a worker proves its id with
    the tokens it accepts; a router with its token and, under cluster mTLS, a signature by the key of its
    router certificate. The worker's gate checks the answers to the cookies issued here (`issuer`)."""

    def __init__(
        self,
        identity: Callable[[], str],
        issuer: ProofIssuer,
        clock: Clock,
        signer: CertificateSigner | None = None,
    ) -> None:
        self._identity = identity
        self._issuer = issuer
        self._clock = clock
        self._signer = signer

    async def Challenge(
        self, request: worker_pb2.IdentityChallenge, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.IdentityProof:
        """Answer one challenge (UNAUTHENTICATED for one out of bounds)."""
        identity = self._identity()
        try:
            answer = self._issuer.answer(identity, request.caller, request.nonce, self._clock.now())
        except Unauthenticated as err:
            await abort(context, err)
        reply = worker_pb2.IdentityProof(
            identity=identity, nonce=answer.server_nonce, token_proofs=answer.token_proofs
        )
        if self._signer is not None:
            transcript = server_transcript(request.caller, identity, request.nonce, answer.server_nonce)
            reply.certificate = self._signer.certificate
            reply.signature = self._signer.sign(transcript)
        return reply


def router_identity_servicer(
    settings: ClusterSettings, router_id: Callable[[], str], clock: Clock
) -> IdentityServicer:
    """What a router serves on its client port so operator tools can check it before sending an admin key."""
    signer = None
    if settings.tls:
        assert settings.cert_file is not None and settings.key_file is not None
        signer = CertificateSigner(settings.cert_file, settings.key_file)
    token = settings.token_value()
    issuer = ProofIssuer([] if token is None else [token])
    return IdentityServicer(lambda: router_identity(router_id()), issuer, clock, signer)


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


def require_worker_credentials(settings: ClusterSettings, worker_id: str) -> None:
    """ConfigError unless the worker can attribute a batch to a router: TLS, a token, or both; under TLS
    its id must be one a certificate can name."""
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
    if settings.tls:
        try:
            worker_tls_name(worker_id)
        except ValueError as exc:
            raise ConfigError(f"worker.worker_id: {exc}") from None
