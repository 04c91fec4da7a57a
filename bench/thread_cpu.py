"""CPU per request by thread, from the kernel's own accounting: what a sampler cannot tell apart.

py-spy (bench/profile_peer.sh, bench/cpu_breakdown.py) counts a thread as busy while it is runnable, and
on one core shared by a router, a worker and etcd a woken thread often waits for the core: those samples
land on the line it woke at (a selector's poll, a queue's get) and read as work. The kernel counts, per
thread, the time it ran and the time it waited runnable (`/proc/PID/task/TID/schedstat`: `run_ns wait_ns
slices`), so the split of a process's CPU over its threads — the event loop, the worker's device thread,
grpc's event-engine threads — is exact, and the waiting is shown beside it rather than mixed in.

    python -m sluice_inference.bench.thread_cpu snap PID [PID ...] > before.json
    ... load ...
    python -m sluice_inference.bench.thread_cpu snap PID [PID ...] > after.json
    python -m sluice_inference.bench.thread_cpu table before.json after.json --requests 5000 \
        --names router worker
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

Snapshot = dict[str, dict[str, tuple[str, int, int]]]
"""Per process id, per thread id: (the thread's name, ns run, ns waited runnable)."""


def snapshot(pids: list[int]) -> Snapshot:
    """Every thread's name and scheduler times, for each process (threads that exit meanwhile are left
    out)."""
    taken: Snapshot = {}
    for pid in pids:
        threads: dict[str, tuple[str, int, int]] = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                ran, waited, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            except (OSError, ValueError):
                continue
            threads[tid] = (name, int(ran), int(waited))
        taken[str(pid)] = threads
    return taken


Row = tuple[str, str, float, float]


def rows(before: Snapshot, after: Snapshot, requests: int, names: dict[str, str]) -> list[Row]:
    """(process, thread, µs run per request, µs waited per request), busiest first within a process; the
    main thread (tid = pid) is the event loop, threads named `event_engine` are grpc's; the rest by name
    and id."""
    table = []
    for pid, threads in after.items():
        earlier = before.get(pid, {})
        for tid, (name, ran, waited) in threads.items():
            _, ran0, waited0 = earlier.get(tid, (name, 0, 0))
            role = "event loop (main thread)" if tid == pid else f"{name} {tid}"
            run_us = (ran - ran0) / 1000 / requests
            wait_us = (waited - waited0) / 1000 / requests
            table.append((names.get(pid, pid), role, run_us, wait_us))
    return sorted(table, key=lambda row: (row[0], -row[2]))


def main(argv: list[str] | None = None) -> int:
    """`snap` prints a snapshot as JSON; `table` prints the markdown table between two."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snap")
    snap.add_argument("pids", type=int, nargs="+")
    table = sub.add_parser("table")
    table.add_argument("before", type=Path)
    table.add_argument("after", type=Path)
    table.add_argument("--requests", type=int, required=True)
    table.add_argument("--names", nargs="*", default=[], help="a name per process, in snapshot order")
    args = parser.parse_args(argv)
    if args.command == "snap":
        json.dump(snapshot(args.pids), sys.stdout)
        return 0
    before, after = json.loads(args.before.read_text()), json.loads(args.after.read_text())
    names = dict(zip(after, args.names, strict=False))
    print("| process | thread | CPU µs per request | waited runnable µs per request |")
    print("|---|---|---|---|")
    for process, role, run_us, wait_us in rows(before, after, max(1, args.requests), names):
        if run_us >= 1 or wait_us >= 1:
            print(f"| {process} | {role} | {run_us:.0f} | {wait_us:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
