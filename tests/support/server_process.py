"""What the test servers (etcd, Redis) share: a log to quote in failures, a folder to remove, a context
manager, and terminate-then-kill with a bound."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Self


def terminate(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL and wait again."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout_s)


class ServerProcess:
    """Base of a server a test runs: subclasses set `base_dir` and `_owns_dir` and implement `log_path`,
    `start` and `stop`."""

    base_dir: Path
    _owns_dir: bool

    @property
    def log_path(self) -> Path:
        """Where the server writes its log."""
        raise NotImplementedError

    def start(self) -> None:
        """Start and wait until it answers."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop; no process is left."""
        raise NotImplementedError

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log, for failure messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def cleanup(self) -> None:
        """Stop the server and remove the folder this object created."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cleanup()
