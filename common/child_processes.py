"""Child processes of a launcher (`sluice up`, `sluice router --processes N`, the benchmarks): started in a
session of their own, so a terminal's Ctrl-C reaches only the launcher, which then stops them in order;
sent SIGTERM by the kernel if the launcher itself dies (PR_SET_PDEATHSIG), so nothing outlives it; and
looked after while they run.

A worker that exits with EXIT_DEVICE_FAULT (its device broke; worker/faults.py) is started again by the
`Supervisor`, as Kubernetes would restart its container, at most RESTART_LIMIT times in any
RESTART_WINDOW_S per worker; past that it stays down (a device that breaks on every start needs a
human). Any other exit is reported.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import IO

from sluice_inference.common.exit_codes import EXIT_DEVICE_FAULT

PR_SET_PDEATHSIG = 1
RESTART_LIMIT = 3
RESTART_WINDOW_S = 60.0


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this child when `sluice up` dies (a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    """A child process with a name and a log destination."""

    def __init__(
        self, name: str, argv: list[str], log_dir: Path | None, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self._argv, self._log_dir, self._env = argv, log_dir, env
        self.log_path = None if log_dir is None else log_dir / f"{name}.log"
        self._log: IO[bytes] | None = None if self.log_path is None else self.log_path.open("ab")
        self._terminated = False
        self.process = subprocess.Popen(
            argv,
            stdout=self._log if self._log else None,
            stderr=subprocess.STDOUT if self._log else None,
            start_new_session=True,
            env=None if env is None else {**os.environ, **env},
            # Safe here: `sluice up` runs no other thread when it starts a child: before its first gRPC
            # channel, or (a restart) once every channel it opened is closed, and gRPC then stops its own.
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )

    def terminate(self) -> None:
        """Send SIGTERM once (a second one would cut a worker's drain short)."""
        if self.alive() and not self._terminated:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def alive(self) -> bool:
        """Whether it is still running."""
        return self.process.poll() is None

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; the exit code."""
        self.terminate()
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(5)
        if self._log:
            self._log.close()
        return code

    def restart(self) -> Child:
        """The same command started again (its log appended to), once this one has exited."""
        if self._log:
            self._log.close()
        return Child(self.name, self._argv, self._log_dir, self._env)


class RestartBudget:
    """At most `limit` restarts in any `window_s` seconds (a sliding window over restart times)."""

    def __init__(self, limit: int = RESTART_LIMIT, window_s: float = RESTART_WINDOW_S) -> None:
        self._limit = limit
        self._window_s = window_s
        self._restarts: deque[float] = deque()

    def take(self, now: float) -> bool:
        """Whether one more restart at `now` is within budget (and if so, count it)."""
        while self._restarts and self._restarts[0] <= now - self._window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self._limit:
            return False
        self._restarts.append(now)
        return True


class Supervisor:
    """Looks after running children: restarts workers that left after a device fault, within each one's
    RestartBudget, reports every other exit once, and says when the cluster can no longer serve."""

    def __init__(
        self, children: list[Child], limit: int = RESTART_LIMIT, window_s: float = RESTART_WINDOW_S
    ) -> None:
        # Entries are replaced in place when a worker restarts, so stop_cluster stops the new process.
        self.children = children
        self._budgets: dict[str, RestartBudget] = {}
        self._limit = limit
        self._window_s = window_s
        self._reported: set[str] = set()

    def check(self, now: float) -> bool:
        """One look at every child; False once etcd or the router has exited (the workers may go)."""
        for index, child in enumerate(self.children):
            if child.alive() or child.name in self._reported:
                continue
            code = child.process.returncode
            if child.name.startswith("worker") and code == EXIT_DEVICE_FAULT:
                budget = self._budgets.setdefault(child.name, RestartBudget(self._limit, self._window_s))
                if budget.take(now):
                    print(f"{child.name} exited with {code} (device fault); restarting it", file=sys.stderr)
                    self.children[index] = child.restart()
                    continue
                print(
                    f"{child.name} exited with {code} (device fault) {self._limit} times within "
                    f"{self._window_s:g} s; leaving it down",
                    file=sys.stderr,
                )
            self._reported.add(child.name)
            print(f"{child.name} exited with {code}", file=sys.stderr, flush=True)
        return all(c.alive() for c in self.children if not c.name.startswith("worker"))
