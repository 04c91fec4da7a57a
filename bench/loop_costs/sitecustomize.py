"""CPU of each asyncio callback, per process: what a cluster's event loops spend their time on while idle.

A sampler cannot answer this on an idle process: py-spy counts a thread parked in gRPC's or the selector's C
code as running, so almost every sample of an idle router lands on a wait. Here every callback an event
loop runs (a task step, a timer, a future's done-callback) is timed with the thread's own CPU clock and
added up under its name (a task's step under its coroutine's), and each process writes the totals to
`$SLUICE_LOOP_COSTS/loop-costs-PID.txt` every `DUMP_EVERY_S` while it runs, and at a normal exit. Python
imports this file at start-up from the first `sitecustomize` on `PYTHONPATH`, so every Sluice process a
command starts is covered (`sluice up`'s cluster passes its environment on):

    mkdir -p /tmp/costs && PYTHONPATH=bench/loop_costs SLUICE_LOOP_COSTS=/tmp/costs \
        python -m sluice_inference.bench.idle_cpu --seconds 20

Costs: two `thread_time_ns` calls and a dict update per callback. Measurement only; nothing in Sluice
imports it. The totals include start-up (the `serve_*` task).
"""

from __future__ import annotations

import asyncio.events
import atexit
import collections
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

DUMP_EVERY_S = 5.0
SHOWN = 30
"""Callbacks written per dump, the costliest first."""


def _name(callback: Any) -> str:
    """A task's step by its coroutine's name; any other callback by its own."""
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro = owner.get_coro()
        return "task " + str(getattr(coro, "__qualname__", None) or type(coro).__name__)
    return str(getattr(callback, "__qualname__", None) or type(callback).__name__)


def _install(folder: Path) -> None:
    cpu_ns: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    run = asyncio.events.Handle._run

    def timed(handle: asyncio.events.Handle) -> None:
        started = time.thread_time_ns()
        try:
            run(handle)
        finally:
            name = _name(handle._callback)  # type: ignore[attr-defined]
            cpu_ns[name] += time.thread_time_ns() - started
            calls[name] += 1

    setattr(asyncio.events.Handle, "_run", timed)  # noqa: B010 (a method patched for measurement)
    began = time.monotonic()
    path = folder / f"loop-costs-{os.getpid()}.txt"

    def write() -> None:
        # Copies first, each one C call under the GIL: the loop's thread adds names while this one reads.
        spent, counted = dict(cpu_ns), dict(calls)
        top = sorted(spent.items(), key=lambda item: item[1], reverse=True)[:SHOWN]
        lines = [f"{' '.join(sys.argv[:3])}: {time.monotonic() - began:.0f} s"]
        lines += [f"{ns / 1e6:10.2f} ms CPU {counted.get(name, 0):7d} calls  {name}" for name, ns in top]
        path.write_text("\n".join(lines) + "\n")

    def write_periodically() -> None:
        while True:
            time.sleep(DUMP_EVERY_S)
            write()

    atexit.register(write)  # a process that exits normally leaves its final totals
    threading.Thread(target=write_periodically, name="loop-costs", daemon=True).start()


if os.environ.get("SLUICE_LOOP_COSTS"):
    _install(Path(os.environ["SLUICE_LOOP_COSTS"]))
