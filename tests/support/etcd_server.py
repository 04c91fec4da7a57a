"""A real single-member etcd for tests, on free loopback ports, with its data in a temporary folder.

Invariants: at most one etcd process per `EtcdServer`; `stop()` always leaves none behind (SIGTERM, then
SIGKILL after a bound), and `start()` either returns with etcd answering or raises with the log's tail
and no process left. Ports and the data folder are chosen once, so `restart()` brings back the same
member at the same endpoint (its keys and leases survive unless `wipe_data=True`). etcd logs to a file
in the folder, never to the test's output. The heartbeat and election timeouts are shortened so a
(re)start elects itself leader in ~0.1 s instead of ~1-2 s.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from cli.cluster import etcd_binary, free_port
from tests.support.server_process import ServerProcess, terminate

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


class EtcdServer(ServerProcess):
    """One etcd member for a test; use as a context manager or call `start()` / `cleanup()`."""

    def __init__(self, base_dir: Path | None = None, *, name: str = "sluice-test") -> None:
        self._owns_dir = base_dir is None
        self.base_dir = Path(tempfile.mkdtemp(prefix="sluice-etcd-")) if base_dir is None else base_dir
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """`127.0.0.1:PORT` of the client listener (what `EtcdSettings.endpoints` takes)."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def data_dir(self) -> Path:
        """etcd's data folder (kept across `restart()`)."""
        return self.base_dir / "data"

    @property
    def log_path(self) -> Path:
        """etcd's log file (appended to across restarts)."""
        return self.base_dir / "etcd.log"

    @property
    def pid(self) -> int | None:
        """PID of the running etcd, else None."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def running(self) -> bool:
        """Whether the etcd process is alive."""
        return self._process is not None and self._process.poll() is None

    def _command(self) -> list[str]:
        client_url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        return [
            str(etcd_binary()),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"{self.name}={peer_url}",
            "--heartbeat-interval",
            "10",
            "--election-timeout",
            "100",
            "--unsafe-no-fsync",  # test data need not survive a machine crash; writes get faster
        ]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start etcd and wait until it serves linearizable reads; raises RuntimeError otherwise."""
        if self.running:
            raise RuntimeError(f"etcd at {self.endpoint} is already running")
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self._command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                self._process = None
                raise RuntimeError(f"etcd exited during start-up:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"etcd at {self.endpoint} not healthy within {timeout_s} s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        """TCP accept, then etcd's /health (leader elected, a quorum read succeeds)."""
        try:
            with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.5):
                pass
            url = f"http://{self.endpoint}/health"
            with urllib.request.urlopen(url, timeout=1.0) as response:
                body = json.loads(response.read())
        except (OSError, urllib.error.URLError, ValueError):
            return False
        return bool(body.get("health") == "true")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; waits for the exit."""
        process, self._process = self._process, None
        if process is not None:
            terminate(process, timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crash would; waits for the exit."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(STOP_TIMEOUT_S)

    def restart(self, *, wipe_data: bool = False, timeout_s: float = START_TIMEOUT_S) -> None:
        """Stop and start again on the same ports; `wipe_data=True` starts from an empty store (a member
        that lost its data: every lease and key is gone)."""
        self.stop()
        if wipe_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start(timeout_s)
