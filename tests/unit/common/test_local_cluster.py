"""The local cluster's supervision (common/local_cluster.py, behind `sluice up`): a worker that exits after
a device fault is restarted, within a budget; any other exit is only reported; the cluster stops serving
only when etcd or the router is gone."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.exit_codes import EXIT_DEVICE_FAULT
from common.local_cluster import Child, RestartBudget, Supervisor


def exits_with(code: int) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.exit({code})"]


SLEEPS = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def children(tmp_path: Path) -> Iterator[list[Child]]:
    """A worker that always exits as after a device fault, one that exits with 1, and a router that
    runs; every process still running is stopped at teardown."""
    started = [
        Child("worker-1", exits_with(EXIT_DEVICE_FAULT), tmp_path),
        Child("worker-2", exits_with(1), tmp_path),
        Child("router", SLEEPS, tmp_path),
    ]
    yield started
    for child in started:
        child.stop(5)


def test_restart_budget_is_a_sliding_window() -> None:
    budget = RestartBudget(limit=2, window_s=10.0)
    assert budget.take(0.0) and budget.take(1.0)
    assert not budget.take(5.0)  # two restarts in the last 10 s already
    assert budget.take(10.5)  # the one at 0.0 has left the window
    assert not budget.take(10.9)
    assert budget.take(11.0)


def test_a_worker_that_left_after_a_device_fault_is_restarted_within_its_budget(
    children: list[Child], capsys: pytest.CaptureFixture[str]
) -> None:
    supervisor = Supervisor(children, limit=2, window_s=60.0)
    pids = [children[0].process.pid]
    for now in (0.0, 1.0, 2.0):
        children[0].process.wait(10)
        children[1].process.wait(10)
        assert supervisor.check(now)  # workers come and go; the cluster still serves
        pids.append(children[0].process.pid)
    assert len(set(pids)) == 3  # the first process and two restarts; the third exit is over budget
    assert not children[0].alive() and children[1].process.returncode == 1
    err = capsys.readouterr().err
    assert err.count(f"worker-1 exited with {EXIT_DEVICE_FAULT} (device fault); restarting it") == 2
    assert (
        f"worker-1 exited with {EXIT_DEVICE_FAULT} (device fault) 2 times within 60 s; leaving it down" in err
    )
    assert err.count("worker-2 exited with 1") == 1  # any other exit: reported once, never restarted
    children[2].stop(5)
    assert not supervisor.check(3.0)  # without the router the cluster cannot serve
