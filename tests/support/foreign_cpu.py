"""How much CPU the rest of the machine took while a test ran: everything but this test process and its
children (the router in-process, spawned workers, etcd, a load generator), and the time a hypervisor gave
other guests while this one wanted it (steal).

A latency test that compares tails measures its own processes only while nothing else competes for the
cores: on these shared 2-core machines a type check or another suite in a neighbouring shell doubled a
p99 of 15 ms on one side of a comparison and not the other, with the test's own load generator keeping
its schedule (tests/integration/test_head_of_line.py). Linux only (/proc).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sluice_inference.bench.calibration import CLOCK_TICKS, process_cpu_s

MIN_WINDOW_S = 1.0
"""The shortest window `ForeignCpu.mark` judges."""
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""/proc/stat's cpu line: user, nice, system, irq, softirq, steal (idle and iowait are not busy)."""


def _machine_busy_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in BUSY_FIELDS) / CLOCK_TICKS


def _children_of() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone since the listing
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    return children


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and every live descendant, with what each has reaped of its exited children
    (so a child's CPU stays counted once it has exited and been waited for)."""
    children = _children_of()
    used, pending = 0.0, [root]
    while pending:
        pid = pending.pop()
        try:
            used += process_cpu_s(pid, reaped=True)
        except OSError:  # gone since the listing
            continue
        pending.extend(children.get(pid, ()))
    return used


class ForeignCpu:
    """CPU the rest of the machine used since this was made (this process's tree excluded), on average and
    in its busiest window (`mark`): a burst of other work makes a tail that the run's average dilutes (a
    quarter of a core for a few seconds of a 15 s run passed an average bound and doubled a p99)."""

    def __init__(self) -> None:
        self._root = os.getpid()
        self._began = time.monotonic()
        self._busy_s = _machine_busy_s()
        self._own_s = tree_cpu_s(self._root)
        self._window = (self._began, 0.0)
        self.peak_cores = 0.0
        """The most foreign cores in one window between two `mark`s (0 until the first)."""

    def mark(self) -> None:
        """End a window here (the first began when this was made) and keep its cores if they are the most
        yet; windows under a second are not judged (the kernel counts CPU in 10 ms ticks per process)."""
        now, used = time.monotonic(), self.cpu_s()
        began, used_then = self._window
        if now - began < MIN_WINDOW_S:
            return
        self.peak_cores = max(self.peak_cores, (used - used_then) / (now - began))
        self._window = (now, used)

    def cpu_s(self) -> float:
        """CPU seconds of foreign work since this was made."""
        return max(0.0, (_machine_busy_s() - self._busy_s) - (tree_cpu_s(self._root) - self._own_s))

    def cores(self) -> float:
        """Average cores of foreign work since this was made."""
        elapsed = time.monotonic() - self._began
        return self.cpu_s() / elapsed if elapsed > 0 else 0.0
