"""`sluice up`: a local cluster of real processes — etcd, one router, N workers — stopped by Ctrl-C.

The launcher itself (children, credentials, start and stop order, the restart supervisor) is
`common/local_cluster.py`, which the benchmarks use too; this module is the command's front end: it checks
the repository, turns SIGINT and SIGTERM into a stop, prints where to go (with the exact commands that
add a worker or a router to the running cluster), and watches the children until told to stop or until
the cluster can no longer serve.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from sluice_inference.common.child_processes import Child, Supervisor
from sluice_inference.common.config import ConfigError
from sluice_inference.common.local_cluster import (
    ClusterEnv,
    Interrupted,
    free_port,
    reachable_host,
    router_host,
    router_listen,
    start_cluster,
    stop_cluster,
)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def _serve_until_stopped(children: list[Child], stop: threading.Event) -> int:
    """Wait for Ctrl-C. A worker may leave (drained with `sluice drain` or SIGTERM: the cluster goes on
    with the others; after a device fault it is restarted); if etcd or the router dies the cluster cannot
    serve, so it stops with an error."""
    supervisor = Supervisor(children)
    while not stop.wait(0.2):
        if not supervisor.check(time.monotonic()):
            print("error: the cluster cannot serve without etcd and the router; stopping", file=sys.stderr)
            return 1
    return 0


def _shell_line(env: Mapping[str, str], *argv: str) -> str:
    """`VAR=value ... sluice ARGS`, quoted for a POSIX shell."""
    assignments = [f"{name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    return " ".join([*assignments, "sluice", *(shlex.quote(arg) for arg in argv)])


def _spare_port(host: str, preferred: int, taken: set[int]) -> int:
    """`preferred` if nothing of this cluster uses it and it can be bound on `host` now, else any free
    port."""
    if preferred not in taken:
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
                sock.bind((host, preferred))
        except OSError:
            pass
        else:
            return preferred
    return free_port()


def join_commands(args: argparse.Namespace, env: ClusterEnv) -> dict[str, str]:
    """The exact shell lines that add a worker or a router to this running cluster, and drain a worker:
    its etcd, its credentials (the run's token file, or the development certificates) and its config."""
    etcd = ["--etcd", f"127.0.0.1:{args.etcd_port}"]
    config = ["--config", str(args.config)] if args.config else []
    metrics = range(args.metrics_port, args.metrics_port + args.router_processes)
    host = router_host(args)
    port = _spare_port(host, args.port + 2, {args.port, args.etcd_port, args.redis_port or 0, *metrics})
    added = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    listen = ["--listen", added, "--metrics-port", "0"]
    # Under --tls a worker's certificate names its id: the added worker gets the next id and its own.
    worker_id = f"worker-{args.workers + 1}"
    worker = ["--worker-id", worker_id] if env.certs is not None else []
    return {
        "worker": _shell_line(
            env.worker_env(worker_id), "worker", *etcd, "--repository", str(args.repository), *worker, *config
        ),
        "router": _shell_line({**env.common, **env.router}, "router", *etcd, *listen, *config),
        "drain": _shell_line(
            {**env.common, **env.operator}, "drain", f"worker-{max(args.workers, 1)}", *etcd, *config
        ),
    }


def _client_target(args: argparse.Namespace) -> str:
    """Where a client on this machine reaches the router (`localhost:PORT` over loopback)."""
    host = reachable_host(router_host(args))
    return f"localhost:{args.port}" if host == "127.0.0.1" else router_listen(args)


def _try_commands(args: argparse.Namespace, env: ClusterEnv) -> list[str]:
    """A first request, a probe and the worker list, exact for this cluster's ports and TLS."""
    tls = [] if env.ca_file is None else ["--tls", "--ca", str(env.ca_file)]
    target = _client_target(args)
    addr = [] if target == "localhost:8001" else ["--addr", target]
    etcd = [] if args.etcd_port == 2379 else ["--etcd", f"127.0.0.1:{args.etcd_port}"]
    return [
        _shell_line({}, "infer", *tls, *addr, "--model", "mlp", "--random"),
        _shell_line({}, "health", *tls, target),
        _shell_line({k: v for k, v in env.common.items() if k.startswith("SLUICE_ETCD__")}, "workers", *etcd),
    ]


def banner(args: argparse.Namespace, env: ClusterEnv, elapsed_s: float) -> str:
    """What `sluice up` prints once every worker takes batches: where things listen, what to try, and how
    to grow the cluster from another terminal."""
    tls = env.ca_file is not None
    lines = [
        f"Sluice is up in {elapsed_s:.1f} s:",
        f"  router   {_client_target(args)}  (KServe v2 gRPC{', TLS' if tls else ''})",
        f"  metrics  http://localhost:{args.metrics_port}/metrics",
        f"  etcd     127.0.0.1:{args.etcd_port}{' (TLS)' if tls else ''}",
    ]
    if router_host(args) not in LOOPBACK_HOSTS:
        lines.append(
            f"  WARNING  the router listens on {router_host(args)}: without a --config whose tenants have "
            "api_keys, anyone who reaches it may call every model and the admin RPCs"
        )
    if env.certs:
        lines.append(f"  certs    {env.certs} (development CA: ca.pem)")
    if env.token_file:
        lines.append(f"  token    {env.token_file} (cluster token: routers, workers and drains need it)")
    if args.redis_port:
        lines.append(f"  redis    127.0.0.1:{args.redis_port} (shared cache, idempotency keys)")
    lines.append(f"  workers  {args.workers} on {args.repository}/")
    lines += ["Try:", *(f"  {command}" for command in _try_commands(args, env))]
    join = join_commands(args, env)
    lines += [
        "Grow it from another terminal (stop what you add before Ctrl-C here):",
        f"  add a worker:  {join['worker']}",
        f"  add a router:  {join['router']}",
        f"  drain one:     {join['drain']}",
        "Ctrl-C stops every process started here.",
    ]
    return "\n".join(lines)


def run_local_cluster(args: argparse.Namespace) -> int:
    """`sluice up`: start, print where to go, serve until SIGINT/SIGTERM, stop everything."""
    if not any(args.repository.glob("*/config.yaml")) and not any(args.repository.glob("*/config.pbtxt")):
        print(
            f"error: no models in {args.repository}/ (run `sluice models init` or `make models`)",
            file=sys.stderr,
        )
        return 1
    stop = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="sluice-etcd-"))
    started = time.monotonic()
    children: list[Child] = []
    try:
        env = start_cluster(args, data_dir, args.log_dir, children, stop)
        print("\n" + banner(args, env, time.monotonic() - started), flush=True)
        return _serve_until_stopped(children, stop)
    except Interrupted:
        return 130
    except (RuntimeError, TimeoutError, FileNotFoundError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_cluster(children)
        shutil.rmtree(data_dir, ignore_errors=True)
