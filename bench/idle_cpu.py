"""What a local cluster costs with no traffic at all: CPU of etcd, the router and each worker while idle.

Starts `sluice up`'s cluster (etcd, one router, `--workers` workers on the demo models) on free ports, lets
it settle, then reads each process's CPU time from /proc over `--seconds` and prints it as a share of one
core. The goal (issue 17): router + one worker + etcd ≤ 2 % of a core, nothing polling faster than its
purpose needs.

    python -m sluice_inference.bench.idle_cpu [--seconds 20] [--workers 1] [--repository models]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from sluice_inference.common.local_cluster import Child, free_port, start_cluster, stop_cluster
from sluice_inference.worker.demo_models import init_demo_repository

SETTLE_S = 5.0
"""Start-up work (warm-up, first registrations, first watches) is over by then."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(children: list[Child], seconds: float) -> dict[str, float]:
    """Each child's CPU over `seconds`, as a percentage of one core."""
    before = {c.name: cpu_seconds(c.process.pid) for c in children}
    time.sleep(seconds)
    return {c.name: 100 * (cpu_seconds(c.process.pid) - before[c.name]) / seconds for c in children}


def main(argv: list[str] | None = None) -> int:
    """Start a cluster, measure it idle, print one line per process and the total."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="measuring window (default 20)")
    parser.add_argument("--workers", type=int, default=1, help="workers to start (default 1)")
    parser.add_argument("--repository", type=Path, help="model repository (default: fresh demo models)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-idle-"))
    repository = args.repository
    if repository is None:
        repository = workdir / "models"
        init_demo_repository(repository)
    cluster = argparse.Namespace(
        etcd_port=free_port(), port=free_port(), metrics_port=free_port(), config=None,
        workers=args.workers, repository=repository, ready_timeout=120.0,
    )  # fmt: skip
    children: list[Child] = []
    try:
        (workdir / "data").mkdir()
        start_cluster(cluster, workdir / "data", workdir, children, threading.Event())
        time.sleep(SETTLE_S)
        shares = measure(children, args.seconds)
    finally:
        stop_cluster(children)
    for name, share in shares.items():
        print(f"{name:<10} {share:5.2f} % of a core")
    print(f"{'total':<10} {sum(shares.values()):5.2f} % of a core over {args.seconds:g} s idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
