"""tests/support/foreign_cpu.py tells the CPU of a test's own process tree from the rest of the machine's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.foreign_cpu import MIN_WINDOW_S, ForeignCpu, tree_cpu_s

BURN = "import time\nwhile time.process_time() < 0.5: pass\n"
"""Half a CPU-second of work, however long the machine takes to give it."""


def test_a_child_s_cpu_is_the_tree_s_also_once_it_has_exited() -> None:
    before = tree_cpu_s(os.getpid())
    subprocess.run([sys.executable, "-c", BURN], check=True)
    assert tree_cpu_s(os.getpid()) - before >= 0.45


def test_a_process_outside_the_tree_is_foreign(tmp_path: Path) -> None:
    done = tmp_path / "done"
    foreign = ForeignCpu()
    # Started through a shell that exits at once: the burner is orphaned, no longer this process's child.
    script = f"{BURN}open({str(done)!r}, 'w').close()\n"
    subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" &', script], check=True)
    deadline = time.monotonic() + 30
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.exists()
    assert foreign.cpu_s() >= 0.45


def test_a_burst_of_other_work_shows_in_its_window_not_diluted_over_the_run(tmp_path: Path) -> None:
    done = tmp_path / "done"
    foreign = ForeignCpu()
    time.sleep(MIN_WINDOW_S)  # a quiet window first
    foreign.mark()
    quiet = foreign.peak_cores
    script = f"{BURN}open({str(done)!r}, 'w').close()\n"
    subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" &', script], check=True)
    deadline = time.monotonic() + 30
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(max(0.0, MIN_WINDOW_S - 0.5))  # the burst's window lasts at least a second
    foreign.mark()
    assert quiet < 0.2
    assert foreign.peak_cores >= 0.3  # half a CPU-second in a window of a second or so
    time.sleep(2 * MIN_WINDOW_S)  # a quiet stretch after it: the average falls, the peak stays
    foreign.mark()
    assert foreign.peak_cores > foreign.cores()
