"""Where a Sluice process spends its CPU, by stage of the request path, from py-spy's raw samples.

`bench/profile_peer.sh` records the router and the worker with `py-spy record --format raw` while the
peers' load generator runs; this script reads those files (one line per distinct stack: frames from the
root to the leaf separated by `;`, then a sample count) and attributes every sample to one stage.

The rule, walking the stack from the leaf towards the root:
1. the first frame in a library we account separately — Prometheus metrics, OpenTelemetry, protobuf
   (de)serialisation, numpy, torch — names the stage (a metric update called from the driver is the
   metric's cost, not the driver's);
2. otherwise the first frame in our own code (router/, worker/, common/) names it, by module — except the
   frame that only runs the event loop (common/event_loop.py `run_server`): on uvloop, whose loop is C,
   it is the nearest Python frame to every sample of the loop and of grpc's Cython callbacks, which
   asyncio's own loop shows as its `_run_once`;
3. otherwise what is left is grpc's own machinery (its aio server, the Cython core) or the event loop.

With the process's CPU seconds and the requests it served over the same window, each stage's share
becomes CPU per request:

    python -m sluice_inference.bench.cpu_breakdown router.raw worker.raw --cpu-s 12.1 8.4 --requests 8000
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

LIBRARY_STAGES: tuple[tuple[str, str], ...] = (
    ("prometheus_client/", "metrics (prometheus_client)"),
    ("opentelemetry/", "tracing (opentelemetry)"),
    ("google/protobuf/", "protobuf"),
    ("numpy/", "numpy"),
    ("torch/", "torch (forward)"),
)
"""Library path fragments whose frames are a stage of their own, wherever they are called from."""

PROJECT_STAGES: tuple[tuple[str, str], ...] = (
    ("router/edge.py", "router: wire edge (parse, door)"),
    ("router/servicer.py", "router: servicer (proto <-> calls)"),
    ("router/kserve_codec.py", "router: servicer (proto <-> calls)"),
    ("router/dataplane.py", "router: data plane (auth, budgets)"),
    ("router/calls.py", "router: data plane (auth, budgets)"),
    ("router/auth.py", "router: data plane (auth, budgets)"),
    ("router/codec.py", "router: validation and decode"),
    ("router/cache_gate.py", "router: cache and idempotency"),
    ("router/idempotency_gate.py", "router: cache and idempotency"),
    ("router/policy/", "router: core (admission, batching, choice)"),
    ("router/driver.py", "router: driver (dispatch, settle)"),
    ("router/worker_link.py", "router: worker stream"),
    ("router/", "router: other"),
    ("worker/servicer.py", "worker: stream servicer"),
    ("worker/runner.py", "worker: runner (queue, merge, answers)"),
    ("worker/device_thread.py", "worker: device thread (decode, stage)"),
    ("worker/executor.py", "worker: device thread (decode, stage)"),
    ("worker/validation.py", "worker: device thread (decode, stage)"),
    ("worker/padding.py", "worker: device thread (decode, stage)"),
    ("worker/backends/", "worker: model call"),
    ("worker/", "worker: other"),
    ("common/", "common"),
)
"""Our modules, most specific first."""

LOOP_RUNNERS = ("common/event_loop.py",)
"""Our frames that only start the event loop: a sample under them and nothing else of ours is the loop's."""

GRPC = "grpc machinery (aio server and core)"
LOOP = "event loop and other"
FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^:()]*)(?::\d+)?\)$")


def stage_of(stack: list[str]) -> str:
    """The stage one sample belongs to (`stack`: frames from the root to the leaf)."""
    files = [_file(frame) for frame in reversed(stack)]
    for path in files:
        for fragment, stage in LIBRARY_STAGES:
            if fragment in path:
                return stage
    for path in files:
        if any(_in_project(path, runner) for runner in LOOP_RUNNERS):
            continue
        for fragment, stage in PROJECT_STAGES:
            if _in_project(path, fragment):
                return stage
    if any("grpc" in path for path in files):
        return GRPC
    return LOOP


def _file(frame: str) -> str:
    match = FRAME.match(frame.strip())
    return match.group("file") if match else frame


def _in_project(path: str, fragment: str) -> bool:
    """Our own file (not a site-packages one whose path happens to contain `router/`)."""
    return fragment in path and "site-packages" not in path


def read_raw(path: Path) -> Counter[str]:
    """Samples per stage in one py-spy raw file."""
    stages: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        stages[stage_of(frames)] += int(count)
    return stages


def table(files: list[Path], cpu_s: list[float] | None, requests: int | None) -> str:
    """A markdown table: per process and stage, the share of samples and (given CPU and requests) the
    CPU per request in µs."""
    rows = ["| process | stage | share of its samples | CPU per request |", "|---|---|---|---|"]
    for index, path in enumerate(files):
        stages = read_raw(path)
        total = sum(stages.values()) or 1
        per_request = None
        if cpu_s is not None and requests:
            per_request = cpu_s[index] / requests * 1e6
        for stage, count in stages.most_common():
            share = count / total
            cost = f"{share * per_request:.0f} µs" if per_request is not None else "-"
            rows.append(f"| {path.stem} | {stage} | {share:.1%} | {cost} |")
        if per_request is not None:
            rows.append(f"| {path.stem} | **total** | 100 % | **{per_request:.0f} µs** |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", nargs="+", type=Path, help="py-spy --format raw files")
    parser.add_argument("--cpu-s", nargs="+", type=float, help="CPU seconds of each process in the window")
    parser.add_argument("--requests", type=int, help="requests served in the window")
    args = parser.parse_args()
    if args.cpu_s is not None and len(args.cpu_s) != len(args.raw):
        parser.error("give one --cpu-s figure per raw file")
    print(table(args.raw, args.cpu_s, args.requests))


if __name__ == "__main__":
    main()
