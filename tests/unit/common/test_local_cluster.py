"""The local cluster's supervision (common/child_processes.py, behind `sluice up`): a worker that exits after
a device fault is restarted, within a budget; any other exit is only reported; the cluster stops serving
only when etcd or the router is gone."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice_inference.common.child_processes import Child, RestartBudget, Supervisor
from sluice_inference.common.config import load_config
from sluice_inference.common.exit_codes import EXIT_DEVICE_FAULT
from sluice_inference.common.local_cluster import _redis_key_env, etcd_env


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


def test_sluice_up_gives_its_routers_a_redis_hmac_key_unless_the_config_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SLUICE_REDIS__HMAC_KEY", "SLUICE_REDIS__HMAC_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    env = _redis_key_env(None, tmp_path)
    path = Path(env["SLUICE_REDIS__HMAC_KEY_FILE"])
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_text()) == 64
    routers = {**env, "SLUICE_REDIS__URL": "redis://127.0.0.1:6379/0"}
    assert load_config(environ=routers).redis.hmac_keys() == [path.read_text().encode()]
    config = tmp_path / "sluice.yaml"
    config.write_text("redis:\n  hmac_key: " + "k" * 32 + "\n")
    assert _redis_key_env(config, tmp_path) == {}  # the config's own key is kept (both would be an error)


def test_sluice_up_runs_its_etcd_on_one_go_processor_unless_gomaxprocs_is_set(tmp_path: Path) -> None:
    assert etcd_env({"GOMAXPROCS": "4"}) == {}
    reads_it = [sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['GOMAXPROCS']))"]
    etcd = Child("etcd", reads_it, tmp_path, etcd_env({}))
    try:
        assert etcd.process.wait(10) == 1
    finally:
        etcd.stop(5)
