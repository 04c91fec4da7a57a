"""What a local cluster costs with no traffic at all: CPU of etcd, the router and each worker while idle.

Starts `sluice up`'s cluster (etcd, one router, `--workers` workers on the demo models) on free ports, lets
it settle, then reads each process's CPU time from /proc over `--seconds` and prints it as a share of one
core. The goal (issue 17): router + one worker + etcd ≤ 2 % of a core, nothing polling faster than its
purpose needs.

Idle CPU swings with the machine's hour more than most changes move it (1.35 % and 2.25 % for the same
code on the same day), so `--beside VAR=VALUE` starts a second cluster with that environment variable set
for all its processes and measures both in the same windows: an A/B that the hour's noise hits alike.

    python -m sluice_inference.bench.idle_cpu [--seconds 20] [--windows 1] [--workers 1] \
        [--repository models] [--beside VAR=VALUE]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from sluice_inference.bench.scratch import scratch_folder
from sluice_inference.common.child_processes import Child
from sluice_inference.common.local_cluster import free_port, start_cluster, stop_cluster
from sluice_inference.worker.demo_models import init_demo_repository

SETTLE_S = 5.0
"""Start-up work (warm-up, first registrations, first watches) is over by then."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(clusters: dict[str, list[Child]], seconds: float) -> dict[str, dict[str, float]]:
    """Each cluster's children's CPU over the same `seconds`, as a percentage of one core."""
    before = {label: {c.name: cpu_seconds(c.process.pid) for c in cs} for label, cs in clusters.items()}
    time.sleep(seconds)
    return {
        label: {c.name: 100 * (cpu_seconds(c.process.pid) - before[label][c.name]) / seconds for c in cs}
        for label, cs in clusters.items()
    }


def start(workdir: Path, workers: int, repository: Path, children: list[Child], env: dict[str, str]) -> None:
    """A `sluice up` cluster in `workdir` into `children`, with `env` set in its processes' environment
    (the variables are this process's own while the children start, then restored)."""
    cluster = argparse.Namespace(
        etcd_port=free_port(), port=free_port(), metrics_port=free_port(), config=None,
        workers=workers, repository=repository, ready_timeout=120.0,
    )  # fmt: skip
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        (workdir / "data").mkdir(parents=True)
        start_cluster(cluster, workdir / "data", workdir, children, threading.Event())
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def beside(text: str) -> tuple[str, str]:
    """`VAR=VALUE`, as argparse's type."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected VAR=VALUE, got {text!r}")
    return name, value


def main(argv: list[str] | None = None) -> int:
    """Start a cluster (two with `--beside`), measure idle, print one line per process and the total."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="measuring window (default 20)")
    parser.add_argument(
        "--windows", type=int, default=1, help="windows measured one after another (default 1)"
    )
    parser.add_argument("--workers", type=int, default=1, help="workers to start (default 1)")
    parser.add_argument("--repository", type=Path, help="model repository (default: fresh demo models)")
    parser.add_argument(
        "--beside", type=beside, metavar="VAR=VALUE",
        help="also start a cluster with VAR=VALUE in its environment, measured in the same windows",
    )  # fmt: skip
    args = parser.parse_args(argv)
    with scratch_folder("sluice-idle-") as workdir:
        repository = args.repository
        if repository is None:
            repository = workdir / "models"
            init_demo_repository(repository)
        variants: dict[str, dict[str, str]] = {"as is": {}}
        if args.beside is not None:
            variants[f"{args.beside[0]}={args.beside[1]}"] = dict([args.beside])
        clusters: dict[str, list[Child]] = {label: [] for label in variants}
        try:
            for number, (label, env) in enumerate(variants.items()):
                start(workdir / f"cluster-{number}", args.workers, repository, clusters[label], env)
            time.sleep(SETTLE_S)
            for window in range(args.windows):
                for label, shares in measure(clusters, args.seconds).items():
                    if len(clusters) > 1 or args.windows > 1:
                        print(f"window {window + 1}, {label}:")
                    for name, share in shares.items():
                        print(f"{name:<10} {share:5.2f} % of a core")
                    print(
                        f"{'total':<10} {sum(shares.values()):5.2f} % of a core over {args.seconds:g} s idle"
                    )
        finally:
            for children in clusters.values():
                stop_cluster(children)
        return 0


if __name__ == "__main__":
    sys.exit(main())
