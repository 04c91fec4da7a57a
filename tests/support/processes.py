"""Real Sluice processes for tests: workers (and local clusters) started with the CLI, on free ports.

Every handle stops its process on `stop()`/`kill()` and tests use them as fixtures, so no process outlives
a test. Waits are bounded polls on observable conditions, never bare sleeps.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sluice_inference.common.trust_settings import EtcdSettings


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> float:
    """Poll until `condition()` holds; return the seconds it took, or fail naming `what`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


async def eventually(
    condition: Callable[[], bool], within_s: float, what: str, interval: float = 0.01
) -> float:
    """`wait_until` for async tests: polls without blocking the loop, so in-process servers keep running."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if condition():
            return time.monotonic() - start
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {within_s:g} s waiting for {what}")


def etcd_env(settings: EtcdSettings) -> dict[str, str]:
    """Environment that points a sluice process at the test's etcd, prefix and lease TTL."""
    return {
        **os.environ,
        "SLUICE_ETCD__ENDPOINTS": f'["{settings.endpoints[0]}"]',
        "SLUICE_ETCD__PREFIX": settings.prefix,
        "SLUICE_ETCD__LEASE_TTL_S": str(settings.lease_ttl_s),
    }


class WorkerProcess:
    """`sluice worker` as a subprocess."""

    def __init__(
        self,
        worker_id: str,
        repository: Path,
        etcd: EtcdSettings,
        log_dir: Path,
        *,
        models: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.log_path = log_dir / f"{worker_id}.log"
        argv = [
            sys.executable,
            "-m",
            "sluice_inference.cli",
            "worker",
            "--repository",
            str(repository),
            "--worker-id",
            worker_id,
        ]
        if models:
            argv += ["--models", models]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**etcd_env(etcd), **(env or {})}
            )

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid

    def signal(self, signum: int) -> None:
        """Send a signal (SIGTERM drains, SIGKILL kills, SIGSTOP freezes)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def wait(self, timeout: float) -> int:
        """Wait for exit; the exit code."""
        return self.process.wait(timeout)

    def stop(self) -> None:
        """Make sure the process is gone (continue it first if it was frozen)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self.process.wait(10)

    def log(self) -> str:
        """What the worker printed (for assertion messages)."""
        return self.log_path.read_text(errors="replace")


def find_pids(*needles: str) -> list[int]:
    """PIDs whose command line contains every needle (Linux /proc), e.g. a worker id and an etcd port."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(needle in cmdline for needle in needles):
            found.append(int(entry.name))
    return found
