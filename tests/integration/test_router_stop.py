"""A router whose stop meets a failing step still releases everything else: its client port closes, its
probe socket's folder goes, and the failure is raised afterwards. (A step that raised once left a gRPC
server running in the test session, and the next test's teardown hung.) A start that fails releases the
same way."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.grpc_server import BindError
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.common.trust_settings import ClusterSettings, EtcdSettings
from sluice_inference.router.main import RouterServer
from tests.integration.conftest import MakeRouter

pytestmark = pytest.mark.integration


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def test_a_failing_stop_step_still_closes_the_port_and_is_raised(
    make_router: MakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = await make_router()
    probe_folder = Path(router.queue_probe.address.removeprefix("unix:")).parent
    assert accepts(router.port) and probe_folder.exists()

    async def unreachable() -> None:
        raise ConnectionError("etcd unreachable")

    monkeypatch.setattr(router.peers, "stop", unreachable)
    with pytest.raises(ConnectionError, match="etcd unreachable"):
        await router.stop(grace=0.1)
    assert not accepts(router.port)
    assert not probe_folder.exists()


async def test_a_router_that_cannot_bind_releases_what_it_took(
    etcd_settings: EtcdSettings, cluster_settings: ClusterSettings
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        router = RouterServer(
            SluiceConfig(
                etcd=etcd_settings,
                cluster=cluster_settings,
                router=RouterSettings(listen=f"127.0.0.1:{port}", metrics_port=0),
            )
        )
        with pytest.raises(BindError, match=f"the router cannot listen on 127.0.0.1:{port}"):
            await router.start()
    probe_folder = Path(router.queue_probe.address.removeprefix("unix:")).parent
    assert router.queue_probe.address and not probe_folder.exists()  # made before the bind, then removed
    await router.stop()  # a second stop has nothing left to do
