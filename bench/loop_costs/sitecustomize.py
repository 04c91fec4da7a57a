"""CPU of each asyncio callback, per process, and the turns of each event loop: what a cluster's event
loops spend their time on, idle or under load.

A sampler cannot answer this on an idle process: py-spy counts a thread parked in gRPC's or the selector's C
code as running, so almost every sample of an idle router lands on a wait. Here every callback an event
loop runs (a task step, a timer, a future's done-callback) is timed with the thread's own CPU clock and
added up under its name (a task's step under its coroutine's), and each process writes the totals to
`$SLUICE_LOOP_COSTS/loop-costs-PID.txt` every `DUMP_EVERY_S` while it runs, and at a normal exit. Python
imports this file at start-up from the first `sitecustomize` on `PYTHONPATH`, so every Sluice process a
command starts is covered (`sluice up`'s cluster passes its environment on):

    mkdir -p /tmp/costs && PYTHONPATH=bench/loop_costs SLUICE_LOOP_COSTS=/tmp/costs \
        python -m sluice_inference.bench.idle_cpu --seconds 20

Each dump also counts the loop's turns (one pass of `_run_once`: the selector's poll, then every callback
that was ready) and how long each turn's callbacks ran, in wall time (a turn's length is what every other
callback waits, whoever had the core meanwhile), by length, with the callbacks that ran in the turns over
`LONG_TURN_S` by name. grpc.aio takes each call in through a chain of callbacks, each in a later turn than
the one before (docs/performance.md, 2026-12-03), so under load turns per call and long turns are what a
call waits to be taken in.

The hooks are asyncio's own loop's: a run with it puts the servers on asyncio's loop, not uvloop
(`SLUICE_EVENT_LOOP=asyncio`, unless the environment names a loop). Costs: two `thread_time_ns` calls, a dict
update and a list append per callback, two `perf_counter` calls per turn and per poll. Measurement only;
nothing in Sluice imports it. The totals include start-up (the `serve_*` task).
"""

from __future__ import annotations

import asyncio.base_events
import asyncio.events
import atexit
import bisect
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
TURN_BOUNDS_MS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
"""Upper bounds of the turn-length classes written (the last class is everything longer)."""
LONG_TURN_S = 0.001
"""Turns whose callbacks ran longer than this are counted by the callbacks that ran in them."""
LONG_SHOWN = 12
"""Callbacks written for the long turns, the most frequent first."""


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
    turn_names: list[str] = []
    """The callbacks run so far in the current turn."""

    def timed(handle: asyncio.events.Handle) -> None:
        started = time.thread_time_ns()
        try:
            run(handle)
        finally:
            name = _name(handle._callback)  # type: ignore[attr-defined]
            cpu_ns[name] += time.thread_time_ns() - started
            calls[name] += 1
            turn_names.append(name)

    setattr(asyncio.events.Handle, "_run", timed)  # noqa: B010 (a method patched for measurement)
    turns = _Turns(turn_names)
    base = asyncio.base_events.BaseEventLoop
    setattr(base, "_run_once", turns.wrap(getattr(base, "_run_once")))  # noqa: B009, B010 (patched for measurement)
    began = time.monotonic()
    path = folder / f"loop-costs-{os.getpid()}.txt"

    def write() -> None:
        # Copies first, each one C call under the GIL: the loop's thread adds names while this one reads.
        spent, counted = dict(cpu_ns), dict(calls)
        top = sorted(spent.items(), key=lambda item: item[1], reverse=True)[:SHOWN]
        elapsed = time.monotonic() - began
        lines = [f"{' '.join(sys.argv[:3])}: {elapsed:.0f} s"]
        lines += [f"{ns / 1e6:10.2f} ms CPU {counted.get(name, 0):7d} calls  {name}" for name, ns in top]
        lines += turns.report(elapsed)
        path.write_text("\n".join(lines) + "\n")

    def write_periodically() -> None:
        while True:
            time.sleep(DUMP_EVERY_S)
            write()

    atexit.register(write)  # a process that exits normally leaves its final totals
    threading.Thread(target=write_periodically, name="loop-costs", daemon=True).start()


class _Turns:
    """Counts an event loop's turns and the wall time of each turn's callbacks (the poll excluded)."""

    def __init__(self, names: list[str]) -> None:
        self.count = 0
        self.callbacks_s = 0.0
        self.by_length = [0] * (len(TURN_BOUNDS_MS) + 1)
        self.long: collections.Counter[str] = collections.Counter()
        self.long_count = 0
        self._names = names
        self._polled_s = 0.0
        self._timed_selectors: set[int] = set()

    def wrap(self, run_once: Any) -> Any:
        """`BaseEventLoop._run_once`, counted."""

        def counted(loop: Any) -> None:
            self._time_polls(loop._selector)
            self._names.clear()
            polled = self._polled_s
            started = time.perf_counter()
            try:
                run_once(loop)
            finally:
                spent = time.perf_counter() - started - (self._polled_s - polled)
                self.count += 1
                self.callbacks_s += spent
                self.by_length[bisect.bisect_left(TURN_BOUNDS_MS, spent * 1e3)] += 1
                if spent > LONG_TURN_S:
                    self.long_count += 1
                    self.long.update(set(self._names))

        return counted

    def _time_polls(self, selector: Any) -> None:
        """Time the selector's poll (once per selector): it is the loop's wait, not a callback's."""
        if id(selector) in self._timed_selectors:
            return
        self._timed_selectors.add(id(selector))
        poll = selector.select

        def timed_poll(timeout: float | None = None) -> Any:
            started = time.perf_counter()
            try:
                return poll(timeout)
            finally:
                self._polled_s += time.perf_counter() - started

        selector.select = timed_poll

    def report(self, elapsed_s: float) -> list[str]:
        """The dump's lines on turns."""
        if not self.count:
            return []
        classes = [f"<{bound:g}" for bound in TURN_BOUNDS_MS] + [f">{TURN_BOUNDS_MS[-1]:g}"]
        lengths = ", ".join(f"{label} {n}" for label, n in zip(classes, self.by_length, strict=True) if n)
        lines = [
            f"turns: {self.count} ({self.count / max(elapsed_s, 1e-9):.0f} a second), callbacks "
            f"{self.callbacks_s:.3f} s of wall time; by length in ms: {lengths}",
            f"turns over {LONG_TURN_S * 1e3:g} ms: {self.long_count}, the callbacks that ran in them:",
        ]
        lines += [f"{n:10d} turns  {name}" for name, n in self.long.most_common(LONG_SHOWN)]
        return lines


if os.environ.get("SLUICE_LOOP_COSTS"):
    # The hooks are asyncio's own loop's (`Handle._run`, `_run_once`): uvloop runs its callbacks in C, past
    # them. So the servers of a measured run take asyncio's loop (common/event_loop.py), unless told.
    os.environ.setdefault("SLUICE_EVENT_LOOP", "asyncio")
    _install(Path(os.environ["SLUICE_LOOP_COSTS"]))
