"""`sluice router --processes N`: one port served by N router processes, for a pod with several cores.

A router is one Python process, so one core: its event loop and gRPC's poller share one GIL. Rather than
threads, the parent starts N ordinary `sluice router` children with the same configuration; each binds the
same listen address with SO_REUSEPORT (gRPC sets it on Linux), so the kernel spreads new connections over
them. Each child registers in etcd as a router of its own (its id gets `-<i>`), so the quota shares
already follow where each tenant's demand lands (docs/admission.md); child i serves /metrics on
`metrics_port + i` (0: each picks a free port).

The parent only supervises: SIGTERM or SIGINT is passed to every child (each drains as a router does) and
it waits for them; a child that exits on its own is started again, at most RESTART_LIMIT times in any
RESTART_WINDOW_S (common/child_processes.py); past that the parent stops the others and exits 1, so the
orchestrator restarts the pod.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType

from sluice_inference.common.child_processes import Child, RestartBudget

POLL_S = 0.2
STOP_TIMEOUT_S = 30.0
"""How long a child may take to drain after SIGTERM before it is killed."""


def child_argv(argv: list[str], index: int, metrics_port: int, router_id: str) -> list[str]:
    """The `sluice` command line of child `index`: the parent's, without `--processes`, with its own
    /metrics port and router id (later flags win in argparse)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--processes":
            skip = True
            continue
        if arg.startswith("--processes="):
            continue
        kept.append(arg)
    port = 0 if metrics_port == 0 else metrics_port + index
    own = ["--metrics-port", str(port)]
    if router_id:
        own += ["--router-id", f"{router_id}-{index}"]
    return [sys.executable, "-m", "sluice_inference.cli", *kept, *own]


def run_router_processes(argv: list[str], processes: int, metrics_port: int, router_id: str) -> int:
    """Start `processes` routers and supervise them until a signal; the exit code."""
    children = [
        Child(f"router-{i}", child_argv(argv, i, metrics_port, router_id), None) for i in range(processes)
    ]
    budgets = [RestartBudget() for _ in children]
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        while not stop.wait(POLL_S):
            for index, child in enumerate(children):
                if child.alive():
                    continue
                exited = child.process.returncode
                if not budgets[index].take(time.monotonic()):
                    print(f"{child.name} exited with {exited} too often; stopping", file=sys.stderr)
                    code = 1
                    stop.set()
                    break
                print(f"{child.name} exited with {exited}; starting it again", file=sys.stderr, flush=True)
                children[index] = child.restart()
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.stop(STOP_TIMEOUT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
