"""The policy core's own CPU per request, driven alone: no simulator, no transport (docs/performance.md).

One `RouterCore` with default settings (the timer batcher, which cuts for an idle worker at once, so the
batch size is the cycle's) and one worker that holds one batch at a time. Each cycle,
`rows` requests arrive while the worker is busy and queue in one lane; then the worker answers its batch
(every item OK), and the tick that answer runs cuts the queued requests as the next batch. So a cycle is
what the core does for `rows` requests: arrival (pre-checks, admission, queueing, the batching decision),
dispatch, and the answer (learning, settling) — at exactly `rows` rows a batch. CPU time is this process's
(`time.process_time`), over the cycles only.

Run: python -m sluice_inference.bench.sim.core_speed [--rows 1,4,16] [--requests 100000]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from sluice_inference.bench.sim.engine import UNLIMITED
from sluice_inference.common.serving_settings import AdmissionSettings, RouterSettings
from sluice_inference.router.policy.batcher import TimerBatcher
from sluice_inference.router.policy.core import RouterCore
from sluice_inference.router.policy.lanes import LaneKey, LaneLimits
from sluice_inference.router.policy.outcomes import BatchAnswer, Dispatch, ItemAnswer
from sluice_inference.router.policy.scheduler import LeastLoaded

KEY = LaneKey("synthetic", "1", (("input", (16,)),))
LIMITS = LaneLimits(max_batch_size=32, max_wait_s=0.002)
WARMUP = {1: 0.0055, 32: 0.021}
"""The simulator's synthetic profile, t(n) = 5 ms + 0.5 ms·n, as a worker's warm-up would time it."""
OK = ItemAnswer()
"""Every item's answer (no outputs: the core never looks at them)."""
CYCLE_S = 0.001
"""Virtual time between two answers: requests arrive within it, well inside their 1 s deadline."""
DEADLINE_S = 1.0


@dataclass(frozen=True)
class CoreSpeed:
    """One measurement: `requests` through the core at `rows` a batch."""

    rows: int
    requests: int
    cpu_s: float

    @property
    def us_per_request(self) -> float:
        """CPU microseconds per request."""
        return 1e6 * self.cpu_s / self.requests


def _answer(dispatch: Dispatch) -> BatchAnswer:
    items = dict.fromkeys([r.request_id for r in dispatch.requests], OK)
    return BatchAnswer(dispatch.batch_id, items, dispatch.rows, 0.0005, 0)  # it holds nothing now


def measure(rows: int, requests: int) -> CoreSpeed:
    """Run `requests` (rounded up to whole cycles) through one core at `rows` a batch."""
    if not 1 <= rows <= LIMITS.max_batch_size:
        raise ValueError(f"rows must lie in 1..{LIMITS.max_batch_size}")
    core = RouterCore(
        0.0, settings=RouterSettings(), admission=AdmissionSettings(), tenants={"t": UNLIMITED},
        batcher=TimerBatcher(), chooser=LeastLoaded(),
    )  # fmt: skip
    core.worker_registered(0.0, "w0", {(KEY.model, KEY.version): WARMUP}, 1, True, device="cpu")
    core.worker_connected(0.0, "w0", True)
    # The first request keeps the worker busy, so each cycle's arrivals queue behind its batch.
    first = core.new_request(
        0.0, lane=KEY, rows=1, deadline=DEADLINE_S, payload=None, tenant="t", priority=1, limits=LIMITS
    )
    [running] = core.arrive(0.0, first).dispatches
    cycles = -(-requests // rows)
    started = time.process_time()
    now = 0.0
    for _ in range(cycles):
        for _ in range(rows):
            request = core.new_request(
                now, lane=KEY, rows=1, deadline=now + DEADLINE_S, payload=None, tenant="t", priority=1,
                limits=LIMITS,
            )  # fmt: skip
            core.arrive(now, request)
        now += CYCLE_S
        [running] = core.answered(now, running.worker_id, _answer(running)).dispatches
        if running.rows != rows:
            raise AssertionError(f"a batch of {running.rows} rows, not {rows}: the cycle broke")
    return CoreSpeed(rows, cycles * rows, time.process_time() - started)


def main(argv: list[str] | None = None) -> int:
    """Print the core's CPU per request at each batch size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16", help="rows per batch, comma-separated")
    parser.add_argument("--requests", type=int, default=100_000, help="requests per batch size")
    args = parser.parse_args(argv)
    for rows in (int(part) for part in args.rows.split(",")):
        speed = measure(rows, args.requests)
        print(
            f"{rows:>3} rows a batch: {speed.requests:,} requests in {speed.cpu_s:.2f} s CPU: "
            f"{speed.us_per_request:.1f} µs per request ({1e6 / speed.us_per_request:,.0f} per CPU-second)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
