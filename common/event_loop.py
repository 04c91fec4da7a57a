"""Which event loop a router or worker process runs on: uvloop where it is installed, else asyncio's own.

Every call a router takes costs grpc.aio's per-call machinery on the event loop (~0.3 ms of CPU on this
project's 2-core machine, most of the router's CPU per request: docs/performance.md), and every batch
costs a few stream messages on both ends. uvloop runs the same loop (callbacks, timers, futures, socket
readiness) in C. Measured on one core shared by router, worker and etcd at 1,200 req/s in the peer harness,
alternating with asyncio's loop (docs/performance.md, "The evening of 2026-12-03, uvloop"): 4 % less CPU
per request, and the rate held within the SLO rose a step. Nothing in the router or worker reaches into a
loop's internals, so either loop runs them alike.

`SLUICE_EVENT_LOOP` chooses (read once, when the process starts its loop): `auto` (the default: uvloop when
importable), `uvloop` (fail when it is missing) or `asyncio` (asyncio's own loop, to compare or to debug).
Only the long-running servers choose here; the CLI's one-shot commands, the load generator and in-process
routers under test run on whatever loop their caller gives them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from sluice_inference.common.config import ConfigError

ENV = "SLUICE_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def loop_name(environ: Mapping[str, str] = os.environ) -> str:
    """The loop a server process should run, `uvloop` or `asyncio`, from `SLUICE_EVENT_LOOP`. Raises
    ConfigError for a value outside `CHOICES`, or for `uvloop` when it is not installed."""
    choice = environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ConfigError(f"{ENV}={choice!r}: choose one of {', '.join(CHOICES)}")
    installed = importlib.util.find_spec("uvloop") is not None
    if choice == "uvloop" and not installed:
        raise ConfigError(f"{ENV}=uvloop, but uvloop is not installed (pip install uvloop)")
    return "uvloop" if choice != "asyncio" and installed else "asyncio"


def running_loop_name() -> str:
    """The running loop's kind, `uvloop` or `asyncio`, for a server's start-up log line."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


def run_server(main: Coroutine[Any, Any, T]) -> T:
    """Run a server's main coroutine to its end on the loop `loop_name` chooses."""
    try:
        name = loop_name()
    except ConfigError:
        main.close()  # never started: no "coroutine was never awaited" warning on top of the error
        raise
    if name == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
