"""The cluster token deploy/overlays/dev publishes authenticates nothing: a real `sluice worker` refuses to
start with it (exit 1, before loading any model) unless started with `--dev`, and with `--dev` it serves
and registers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from sluice_inference.common.dev_token import DEV_CLUSTER_TOKEN
from sluice_inference.common.etcd import WORKERS, open_client
from sluice_inference.common.trust_settings import EtcdSettings
from tests.support.processes import etcd_env

pytestmark = pytest.mark.integration


def start_worker(
    demo_repo: Path, etcd: EtcdSettings, log: Path, *flags: str, token: str = DEV_CLUSTER_TOKEN
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "sluice_inference.cli",
        "worker",
        "--repository",
        str(demo_repo),
        "--models",
        "synthetic",
    ]
    env = {**etcd_env(etcd), "SLUICE_CLUSTER__TOKEN": token}
    with log.open("wb") as out:
        return subprocess.Popen(
            [*argv, "--worker-id", "w-dev", *flags], stdout=out, stderr=subprocess.STDOUT, env=env
        )


def test_a_worker_without_dev_refuses_the_published_token(
    demo_repo: Path, etcd_settings: EtcdSettings, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    worker = start_worker(demo_repo, etcd_settings, log)
    try:
        assert worker.wait(60) == 1, log.read_text()
    finally:
        worker.kill()
        worker.wait(10)
    assert "--dev" in log.read_text() and "deploy/overlays/dev" in log.read_text()


async def test_a_worker_with_dev_accepts_it_and_registers(
    demo_repo: Path, etcd_settings: EtcdSettings, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    worker = start_worker(demo_repo, etcd_settings, log, "--dev")
    client = await open_client(etcd_settings)
    try:
        key = (etcd_settings.prefix + WORKERS + "w-dev").encode()
        for _ in range(600):
            if await client.get(key) is not None or worker.poll() is not None:
                break
            await asyncio.sleep(0.1)
        assert worker.poll() is None, log.read_text()
        assert await client.get(key) is not None, f"the --dev worker never registered: {log.read_text()}"
    finally:
        await client.close()
        worker.terminate()
        worker.wait(30)
