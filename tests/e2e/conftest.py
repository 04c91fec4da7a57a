"""A real local cluster (`sluice up`: etcd, router, two workers) on free ports, shared by a module."""

from __future__ import annotations

import contextlib
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice_inference.common.local_cluster import free_port
from tests.support.processes import find_pids, wait_until


@dataclass(frozen=True)
class Cluster:
    """Where the local cluster listens, and its `sluice up` process."""

    process: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    etcd_port: int
    repository: Path
    log_dir: Path

    @property
    def addr(self) -> str:
        """The router's gRPC address."""
        return f"127.0.0.1:{self.port}"

    def token_env(self) -> dict[str, str]:
        """Environment giving a CLI command this cluster's router ↔ worker token (from `sluice up`'s
        banner), as an operator would set it for `sluice drain`."""
        found = re.search(r"token +(\S+) ", (self.log_dir / "up.log").read_text())
        assert found, "sluice up printed no token file"
        return {"SLUICE_CLUSTER__TOKEN_FILE": found.group(1)}

    def banner_line(self, label: str) -> str:
        """The command `sluice up` printed after `label:` in its banner (e.g. "add a worker")."""
        return banner_line(self.log_dir / "up.log", label)

    def pids(self) -> list[int]:
        """Every process of this cluster (they all carry its etcd port on their command line)."""
        return find_pids(f"127.0.0.1:{self.etcd_port}")


def banner_line(log: Path, label: str) -> str:
    """The command `sluice up` printed after `label:` in its banner, in its output `log`."""
    found = re.search(rf"^ +{re.escape(label)}: +(.+)$", log.read_text(), re.M)
    assert found, f"sluice up printed no {label!r} line"
    return found.group(1)


def shell_command(line: str) -> tuple[dict[str, str], list[str]]:
    """A printed or documented `VAR=value ... sluice ARGS` line: its environment assignments, and the argv
    that runs it with this interpreter."""
    words = shlex.split(line)
    env = {}
    while words and re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[:1] == ["sluice"], line
    return env, [sys.executable, "-m", "sluice_inference.cli", *words[1:]]


@contextlib.contextmanager
def local_cluster(repository: Path, log_dir: Path, *extra: str) -> Iterator[Cluster]:
    """`sluice up` on `repository` (two workers unless `extra` says otherwise) until the block ends; then
    stopped with SIGINT (Ctrl-C), which must leave no process behind."""
    port, metrics_port, etcd_port = free_port(), free_port(), free_port()
    argv = [
        sys.executable, "-m", "sluice_inference.cli", "up", "--repository", str(repository), "--port",
        str(port), "--metrics-port", str(metrics_port), "--etcd-port", str(etcd_port), "--log-dir",
        str(log_dir), *extra,
    ]  # fmt: skip
    with (log_dir / "up.log").open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    cluster = Cluster(process, port, metrics_port, etcd_port, repository, log_dir)
    try:
        wait_until(
            lambda: b"Sluice is up" in (log_dir / "up.log").read_bytes() or process.poll() is not None,
            120,
            "sluice up",
        )
        assert process.poll() is None, (log_dir / "up.log").read_text()
        yield cluster
    finally:
        interrupt(process, etcd_port, log_dir / "up.log")


@pytest.fixture(scope="module")
def cluster(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """`sluice up` with two workers on the demo models; stopped with SIGINT (Ctrl-C) at teardown."""
    with local_cluster(demo_repo, tmp_path_factory.mktemp("cluster-logs")) as running:
        yield running


def interrupt(process: subprocess.Popen[bytes], etcd_port: int, log: Path) -> None:
    """Ctrl-C `sluice up`: it must exit 0 and leave no process of its cluster behind (they all carry its
    etcd port on their command line)."""
    process.send_signal(signal.SIGINT)
    try:
        code = process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    wait_until(lambda: not find_pids(f"127.0.0.1:{etcd_port}"), 10, "every cluster process to exit")
    assert code == 0, log.read_text()
