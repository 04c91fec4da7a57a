"""The worker port's gate: `sluice.v1.Worker/Stream` and `sluice.v1.WorkerAdmin/*` only for callers that
proved they belong to the cluster (docs/security.md, "Router → worker").

- Token: the caller's proof (common/cluster_proof.py) over a challenge this worker issued, for this very
  method, once; checked on the metadata before the request is read
  (`sluice_inference.common.grpc_gate.GateInterceptor`), so a refused stream reads no batch.
- mTLS: the TLS handshake already required a client certificate from the cluster CA; on top, a stream
  needs one naming a router (`router.sluice`) and an admin call one naming a router or an operator tool
  (`admin.sluice`), checked as the handler starts (before a stream's first batch is read).
Health, reflection and `ClusterIdentity` stay open. Anything else on the port is closed (fail closed).
"""

from __future__ import annotations

from typing import Any

from sluice_inference.common.clock import Clock
from sluice_inference.common.cluster_auth import STREAM_METHOD, caller_claim, worker_identity
from sluice_inference.common.cluster_identity import ADMIN_NAME, ROUTER_NAME, peer_names
from sluice_inference.common.cluster_proof import ProofIssuer
from sluice_inference.common.errors import PermissionDenied
from sluice_inference.common.grpc_gate import is_open


class ClusterProofGate:
    """A `CallCheck`: UNAUTHENTICATED unless the call carries a valid caller proof (token clusters)."""

    def __init__(self, worker_id: str, issuer: ProofIssuer, clock: Clock) -> None:
        self._identity = worker_identity(worker_id)
        self._issuer = issuer
        self._clock = clock

    def __call__(self, method: str, metadata: Any) -> None:
        """Return for open methods and proven callers; raise Unauthenticated otherwise."""
        if is_open(method):
            return
        self._issuer.check(self._identity, caller_claim(metadata), method, self._clock.now())


def check_peer_role(method: str, context: Any) -> None:
    """A `PeerCheck` (mTLS clusters): the client certificate names a router, or for admin calls a router
    or an operator tool; PERMISSION_DENIED otherwise (e.g. another worker's certificate)."""
    if is_open(method):
        return
    names = peer_names(context.auth_context())
    allowed = {ROUTER_NAME} if method == STREAM_METHOD else {ROUTER_NAME, ADMIN_NAME}
    if names & allowed:
        return
    raise PermissionDenied(
        f"this worker takes {'streams' if method == STREAM_METHOD else 'this call'} only from a certificate "
        f"naming {' or '.join(sorted(allowed))}",
        reason="not_a_router",
    )


def stream_caller(context: Any) -> str:
    """Who opened a stream, for the worker's logs: the proven caller (token), else the certificate's names."""
    claim = caller_claim(context.invocation_metadata())
    if claim is not None:
        return claim.caller
    names = peer_names(context.auth_context())
    return ",".join(sorted(names)) or "unknown"
