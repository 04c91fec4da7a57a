"""The worker port's gate: `sluice.v1.Worker/Stream` and `sluice.v1.WorkerAdmin/*` need the cluster token
(when one is configured; mTLS is enforced by the TLS handshake itself, before any call exists).

Decided before the request is read (`common.grpc_gate.GateInterceptor`): a refused stream reads no batch.
Health and reflection stay open for probes. Anything else on the port needs the token too (fail closed).
"""

from __future__ import annotations

from typing import Any

from common.cluster_auth import TOKEN_HEADER, TokenCheck
from common.errors import Unauthenticated
from common.grpc_gate import is_open, metadata_value


class ClusterTokenGate:
    """A `CallCheck`: UNAUTHENTICATED unless the call carries an accepted cluster token."""

    def __init__(self, tokens: TokenCheck) -> None:
        self._tokens = tokens

    def __call__(self, method: str, metadata: Any) -> None:
        """Return for open methods and calls with an accepted token; raise Unauthenticated otherwise."""
        if is_open(method):
            return
        presented = metadata_value(metadata, TOKEN_HEADER)
        if self._tokens.allows(presented):
            return
        raise Unauthenticated(
            "this worker serves only routers of its cluster: missing or wrong cluster token",
            reason="missing_cluster_token" if presented is None else "bad_cluster_token",
        )
