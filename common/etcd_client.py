"""An aetcd client that can dial etcd over TLS, and authenticates as an etcd user.

aetcd 1.0 opens only plaintext channels (`Client.connect` calls `insecure_channel`) and cannot be given
credentials. `EtcdClient` replaces just that step: it opens the channel (TLS when credentials are given),
asks etcd for an auth token when a user is configured, and sets up the same stubs aetcd's connect
would; every other call is aetcd's own. The token rides in the metadata of each call.

etcd's auth tokens expire (`--auth-token-ttl`, 300 s by default, counted from last use). A call with an
expired token fails UNAUTHENTICATED, which common/etcd.py treats like any other etcd failure: it drops
the client and opens a fresh one, and a fresh client authenticates again in `connect`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc


class EtcdClient(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type information
    """`aetcd.Client` over a channel we open: TLS with `credentials` (None: plaintext), and the etcd user
    `username` authenticated with `password` (None: etcd without auth)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        credentials: grpc.ChannelCredentials | None,
        username: str | None,
        password: str | None,
        timeout: float,
        options: dict[str, Any],
    ) -> None:
        super().__init__(
            host=host, port=port, username=username, password=password, timeout=timeout, options=options
        )
        self._credentials = credentials
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> None:
        """Open the channel, authenticate, and set up aetcd's stubs (once; concurrent callers wait)."""
        async with self._connect_lock:
            if self._connected.is_set():
                return
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(target, options=options)
            else:
                channel = grpc.aio.secure_channel(target, self._credentials, options=options)
            try:
                self.metadata = await self._authenticate(channel)
            except BaseException:
                await channel.close()
                raise
            self.channel = channel
            self.kvstub = aetcd.rpc.KVStub(channel)
            self.clusterstub = aetcd.rpc.ClusterStub(channel)
            self.leasestub = aetcd.rpc.LeaseStub(channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(channel)
            self._watcher = aetcd.watcher.Watcher(
                aetcd.rpc.WatchStub(channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()

    async def _authenticate(self, channel: grpc.aio.Channel) -> tuple[tuple[str, str], ...] | None:
        """etcd's auth token as call metadata; None without a user. Failures are aetcd ClientErrors
        (what callers already treat as "etcd did not answer properly"), naming the user, not the password."""
        if self._username is None:
            return None
        self.auth_stub = aetcd.rpc.AuthStub(channel)
        request = aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)
        try:
            reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            failure = (
                aetcd.exceptions.ConnectionFailedError
                if exc.code() == grpc.StatusCode.UNAVAILABLE
                else aetcd.exceptions.UnauthenticatedError
            )
            raise failure(
                f"etcd authentication as {self._username!r} failed: {exc.code().name}: {exc.details()}"
            ) from None
        return (("token", reply.token),)
