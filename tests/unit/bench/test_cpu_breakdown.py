"""bench/cpu_breakdown.py attributes each py-spy sample to one stage of the request path."""

from __future__ import annotations

from pathlib import Path

from sluice_inference.bench.cpu_breakdown import GRPC, LOOP, read_raw, stage_of

ROOT = "/work/p/sluice_inference"
RUNNER = [f"<module> ({ROOT}/cli/__main__.py:4)", f"run_server ({ROOT}/common/event_loop.py:62)"]
"""A server process's frames down to its loop, as uvloop leaves them (the loop itself is C)."""


def test_a_sample_in_our_code_under_the_loop_is_that_stage() -> None:
    stack = [
        *RUNNER,
        f"Driver.infer ({ROOT}/router/driver.py:174)",
        "RouterCore.arrive (x/router/policy/core.py:9)",
    ]
    assert stage_of(stack) == "router: core (admission, batching, choice)"


def test_uvloops_runner_frame_alone_is_the_loop_not_common() -> None:
    assert stage_of([*RUNNER, "Runner.run (/usr/lib/python3.11/asyncio/runners.py:118)"]) == LOOP
    with_grpc = [*RUNNER, "_handle_events (/v/site-packages/grpc/aio/_server.py:10)"]
    assert stage_of(with_grpc) == GRPC


def test_other_common_code_is_still_common_and_libraries_win() -> None:
    assert stage_of([*RUNNER, f"MonotonicClock.now ({ROOT}/common/clock.py:59)"]) == "common"
    metric = [
        *RUNNER,
        f"Driver._settle ({ROOT}/router/driver.py:9)",
        "inc (/v/site-packages/prometheus_client/m.py:1)",
    ]
    assert stage_of(metric) == "metrics (prometheus_client)"


def test_raw_files_sum_samples_per_stage(tmp_path: Path) -> None:
    raw = tmp_path / "router.raw"
    loop = ";".join([*RUNNER, "Runner.run (/usr/lib/python3.11/asyncio/runners.py:118)"])
    core = ";".join([*RUNNER, f"RouterCore.arrive ({ROOT}/router/policy/core.py:9)"])
    raw.write_text(f"process 1;thread (0x1);{loop} 30\n{core} 12\n{loop} 5\n")
    assert read_raw(raw) == {LOOP: 35, "router: core (admission, batching, choice)": 12}
