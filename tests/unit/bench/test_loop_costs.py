"""bench/loop_costs: a process started with it writes the CPU its event loop's callbacks spent, by name, and
its loop's turns by length, the long ones by what ran in them; without `SLUICE_LOOP_COSTS` nothing is
patched or written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import sluice_inference.bench

COSTS_DIR = Path(sluice_inference.bench.__file__).parent / "loop_costs"
PROGRAM = """
import asyncio, time

async def spins():
    for _ in range(5):
        until = time.thread_time() + 0.02
        while time.thread_time() < until:
            pass
        await asyncio.sleep(0)

asyncio.run(spins())
"""


def _run(env: dict[str, str], program: str = PROGRAM) -> str:
    env = {
        **{k: v for k, v in os.environ.items() if k != "SLUICE_LOOP_COSTS"},
        "PYTHONPATH": str(COSTS_DIR),
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-"], input=program, text=True, env=env, timeout=60, check=True, capture_output=True
    )
    return done.stdout


def test_each_task_is_charged_the_cpu_its_steps_spent(tmp_path: Path) -> None:
    _run({"SLUICE_LOOP_COSTS": str(tmp_path)})
    [written] = tmp_path.glob("loop-costs-*.txt")
    line = next(line for line in written.read_text().splitlines() if line.endswith("task spins"))
    match = re.fullmatch(r"\s*([\d.]+) ms CPU\s+(\d+) calls  task spins", line)
    assert match is not None, line
    cpu_ms, steps = float(match[1]), int(match[2])
    assert 100 <= cpu_ms < 1000  # five steps of 20 ms of its thread's CPU each
    assert steps == 6  # the five that spin and the one that returns


def test_turns_are_counted_by_length_and_the_long_ones_by_the_callbacks_that_ran_in_them(
    tmp_path: Path,
) -> None:
    _run({"SLUICE_LOOP_COSTS": str(tmp_path)})
    [written] = tmp_path.glob("loop-costs-*.txt")
    text = written.read_text()
    turns_line = r"^turns: (\d+) \(\d+ a second\), callbacks [\d.]+ s of wall time; by length in ms: (.*)$"
    counted = re.search(turns_line, text, re.MULTILINE)
    assert counted is not None, text
    lengths = dict(entry.split(" ") for entry in counted[2].split(", "))
    over_20_ms = int(lengths.get("<50", 0)) + int(lengths.get(">50", 0))
    assert over_20_ms >= 5  # each spin: 20 ms of its thread's CPU
    assert int(counted[1]) == sum(int(n) for n in lengths.values()) >= 6
    spins = re.search(r"^\s+(\d+) turns  task spins$", text, re.MULTILINE)
    assert spins is not None, text
    assert 5 <= int(spins[1]) <= 6  # the five spins (the returning step too, if the machine stalled it)


def test_without_the_variable_the_event_loop_is_left_alone(tmp_path: Path) -> None:
    shows = "import asyncio.events; print(asyncio.events.Handle._run.__qualname__)"
    assert _run({}, shows).strip() == "Handle._run"
    assert _run({"SLUICE_LOOP_COSTS": str(tmp_path)}, shows).strip() != "Handle._run"  # the check can fail
