"""A real single-member etcd for tests, on free loopback ports, with its data in a temporary folder.

Invariants: at most one etcd process per `EtcdServer`; `stop()` always leaves none behind (SIGTERM, then
SIGKILL after a bound), and `start()` either returns with etcd answering or raises with the log's tail
and no process left. Ports and the data folder are chosen once, so `restart()` brings back the same
member at the same endpoint (its keys and leases survive unless `wipe_data=True`). etcd logs to a file
in the folder, never to the test's output. The heartbeat and election timeouts are shortened so a
(re)start elects itself leader in ~0.1 s instead of ~1-2 s.

With `certs` (a `sluice certs dev` folder) the client listener speaks TLS with its `etcd.pem`;
`enable_auth(password)` creates the `root` user and turns etcd's authentication on (with etcdctl, as an
operator would); `auth_token_ttl_s` shortens how long an idle auth token lives (etcd's default is 300 s).
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from sluice_inference.common.local_cluster import etcd_binary, etcd_tls_flags, free_port
from tests.support.server_process import ServerProcess, terminate

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


class EtcdServer(ServerProcess):
    """One etcd member for a test; use as a context manager or call `start()` / `cleanup()`."""

    def __init__(
        self,
        base_dir: Path | None = None,
        *,
        name: str = "sluice-test",
        certs: Path | None = None,
        auth_token_ttl_s: int | None = None,
    ) -> None:
        self.certs = certs
        self.auth_token_ttl_s = auth_token_ttl_s
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

    @property
    def scheme(self) -> str:
        """`https` when serving TLS, else `http`."""
        return "http" if self.certs is None else "https"

    def _command(self) -> list[str]:
        client_url = f"{self.scheme}://127.0.0.1:{self.client_port}"
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
            *self._security_flags(),
        ]

    def _security_flags(self) -> list[str]:
        flags = []
        if self.certs is not None:
            flags += etcd_tls_flags(self.certs)
        if self.auth_token_ttl_s is not None:
            flags += ["--auth-token-ttl", str(self.auth_token_ttl_s)]
        return flags

    def etcdctl(self, *args: str, password: str | None = None) -> str:
        """Run etcdctl against this member (as `root` when `password` is given); its output."""
        argv = [str(etcd_binary().with_name("etcdctl")), "--endpoints", f"{self.scheme}://{self.endpoint}"]
        if self.certs is not None:
            argv += ["--cacert", str(self.certs / "ca.pem")]
        if password is not None:
            argv += ["--user", f"root:{password}"]
        done = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=15, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def enable_auth(self, password: str) -> None:
        """Create the `root` user with `password` and turn authentication on."""
        self.etcdctl("user", "add", f"root:{password}")
        self.etcdctl("auth", "enable")

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
            url = f"{self.scheme}://{self.endpoint}/health"
            context = None if self.certs is None else ssl.create_default_context(cafile=self.certs / "ca.pem")
            with urllib.request.urlopen(url, timeout=1.0, context=context) as response:
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
