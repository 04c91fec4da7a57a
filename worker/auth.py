"""The worker port's gate: `sluice.v1.Worker/Stream` and `sluice.v1.WorkerAdmin/*` need the cluster token
(when one is configured; mTLS is enforced by the TLS handshake itself, before any call exists).

Decided before the request is read (common/grpc_gate.py): a refused stream reads no batch. Health and
reflection stay open for probes. Anything else on the port needs the token too (fail closed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from common.cluster_auth import TOKEN_HEADER, TokenCheck
from common.errors import Unauthenticated
from common.grpc_gate import Handler, is_open, metadata_value, refusal


class ClusterTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without an accepted cluster token (UNAUTHENTICATED)."""

    def __init__(self, check: TokenCheck) -> None:
        self._check = check

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        """Pass open methods and calls carrying an accepted token; refuse the rest unread."""
        handler = await continuation(handler_call_details)
        if handler is None or is_open(handler_call_details.method):
            return handler
        presented = metadata_value(handler_call_details.invocation_metadata, TOKEN_HEADER)
        if self._check.allows(presented):
            return handler
        reason = "missing_cluster_token" if presented is None else "bad_cluster_token"
        return refusal(
            handler,
            Unauthenticated(
                "this worker serves only routers of its cluster: missing or wrong cluster token",
                reason=reason,
            ),
        )
