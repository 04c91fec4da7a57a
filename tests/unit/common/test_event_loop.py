"""Which event loop a server process runs (common/event_loop.py): uvloop by default where it is installed,
asyncio's own on request, and a clear configuration error for anything else."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect

import pytest

from sluice_inference.common.config import ConfigError
from sluice_inference.common.event_loop import ENV, loop_name, run_server, running_loop_name


async def _kind() -> str:
    return running_loop_name()


def test_uvloop_is_a_dependency_of_this_install() -> None:
    """`make install` installs it (pyproject.toml, constraints.txt): the servers run on it by default."""
    assert importlib.util.find_spec("uvloop") is not None
    assert loop_name({}) == "uvloop"


@pytest.mark.parametrize(
    ("value", "chosen"), [("auto", "uvloop"), ("", "uvloop"), ("UVLOOP", "uvloop"), (" asyncio ", "asyncio")]
)
def test_the_environment_chooses_the_loop(value: str, chosen: str) -> None:
    assert loop_name({ENV: value}) == chosen


@pytest.mark.parametrize("chosen", ["uvloop", "asyncio"])
def test_a_server_runs_on_the_chosen_loop(chosen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, chosen)
    assert run_server(_kind()) == chosen


def test_an_unknown_choice_is_a_configuration_error_and_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "trio")
    started = _kind()
    with pytest.raises(ConfigError, match="SLUICE_EVENT_LOOP='trio': choose one of auto, uvloop, asyncio"):
        run_server(started)
    assert inspect.getcoroutinestate(started) == inspect.CORO_CLOSED  # closed, never run


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A platform without uvloop (Windows, or an install that left it out)."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert loop_name({}) == "asyncio"
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        loop_name({ENV: "uvloop"})


def test_the_default_loop_of_this_test_session_is_untouched() -> None:
    """Only servers choose: in-process routers under test run on the loop their caller gives them."""
    assert asyncio.get_event_loop_policy().__class__.__module__.startswith("asyncio")
