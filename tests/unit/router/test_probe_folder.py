"""The queue probe's socket folder exists only while a router is bound: a router built and never started
(an in-process bench or a test) made one per build in the shared temporary folder and never removed it."""

from __future__ import annotations

import stat
import tempfile
from pathlib import Path

import grpc
import pytest

from sluice_inference.common.config import SluiceConfig
from sluice_inference.router.main import RouterServer


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where `tempfile` makes folders during the test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def entries(root: Path) -> list[Path]:
    return list(root.iterdir())


def test_building_a_router_makes_no_folder(temp_root: Path) -> None:
    router = RouterServer(SluiceConfig())
    assert router.queue_probe.address == ""
    assert entries(temp_root) == []


async def test_the_folder_is_private_while_bound_and_gone_after_stop(temp_root: Path) -> None:
    router = RouterServer(SluiceConfig())
    server = grpc.aio.server()
    try:
        router.queue_probe.listen_on(server)
        (folder,) = entries(temp_root)
        assert router.queue_probe.address == f"unix:{folder / 'probe.sock'}"
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        await router.queue_probe.stop()
        assert entries(temp_root) == []
    finally:
        await server.stop(None)
