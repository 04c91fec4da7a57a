"""A real `sluice worker` process runs on the event loop common/event_loop.py chooses, and says which."""

from __future__ import annotations

import pytest

from sluice_inference.cli.parsing import EXIT_BAD_ARGS
from tests.integration.conftest import Spawn
from tests.support.processes import eventually

pytestmark = pytest.mark.integration


async def test_a_worker_runs_on_uvloop_unless_told_asyncio(spawn: Spawn) -> None:
    default = spawn("w-default")
    chosen = spawn("w-asyncio", env={"SLUICE_EVENT_LOOP": "asyncio"})

    def ready_on(worker_log: str, loop: str) -> bool:
        return f"model versions ({loop} event loop)" in worker_log

    await eventually(lambda: ready_on(default.log_path.read_text(), "uvloop"), 60, "w-default on uvloop")
    await eventually(lambda: ready_on(chosen.log_path.read_text(), "asyncio"), 60, "w-asyncio on asyncio")


async def test_an_unknown_loop_is_refused_at_start_with_the_variable_named(spawn: Spawn) -> None:
    worker = spawn("w-bad", env={"SLUICE_EVENT_LOOP": "gevent"})
    assert worker.wait(60) == EXIT_BAD_ARGS
    assert "configuration error: SLUICE_EVENT_LOOP='gevent'" in worker.log_path.read_text()
