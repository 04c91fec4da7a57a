"""`sluice up`: a local cluster of real processes — etcd, one router, N workers — stopped by Ctrl-C.

The launcher itself (children, credentials, start and stop order, the restart supervisor) is
`common/local_cluster.py`, which the benchmarks use too; this module is the command's front end: it checks
the repository, turns SIGINT and SIGTERM into a stop, prints where to go, and watches the children until
told to stop or until the cluster can no longer serve.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from common.config import ConfigError
from common.local_cluster import (
    TOKEN_ENV,
    Child,
    Interrupted,
    Supervisor,
    start_cluster,
    stop_cluster,
)


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
        tls = "" if env.ca_file is None else f" --tls --ca {env.ca_file}"
        print(
            f"\nSluice is up in {time.monotonic() - started:.1f} s:\n"
            f"  router   localhost:{args.port}  (KServe v2 gRPC{', TLS' if tls else ''})\n"
            f"  metrics  http://localhost:{args.metrics_port}/metrics\n"
            f"  etcd     127.0.0.1:{args.etcd_port}{' (TLS)' if tls else ''}\n"
            + (f"  certs    {env.certs} (development CA: ca.pem)\n" if env.certs else "")
            + (
                f"  token    {env.token_file} (cluster token; `sluice drain` wants {TOKEN_ENV}=<it>)\n"
                if env.token_file
                else ""
            )
            + (
                f"  redis    127.0.0.1:{args.redis_port} (shared cache, idempotency keys)\n"
                if args.redis_port
                else ""
            )
            + f"  workers  {args.workers} on {args.repository}/\n"
            f"Try:  sluice infer{tls} --model mlp --random   |   sluice health{tls} localhost:{args.port}"
            + ("" if tls else "   |   sluice workers")
            + "\n"
            "Ctrl-C stops every process started here.",
            flush=True,
        )
        return _serve_until_stopped(children, stop)
    except Interrupted:
        return 130
    except (RuntimeError, TimeoutError, FileNotFoundError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_cluster(children)
        shutil.rmtree(data_dir, ignore_errors=True)
