"""The overload experiment (issue 3): 3 x capacity on a real local cluster, with and without admission.

A local cluster (`sluice up`, one worker) serves a `synthetic` model whose simulated device time is
t(b) = s·(20 ms + 2 ms·b) with batches of up to 8, so its capacity is C = 8 / (s·36 ms), ≈ 222 req/s at
s = 1. Tenant `gold` (priority 1) offers 0.5 x C and `bronze` (priority 3) 2.5 x C, open-loop, every
request with an s·500 ms deadline. While the load runs, the router's /metrics are sampled (deepest lane,
resident memory); after it, we check that the queues are empty within one deadline.

The experiment is worker-bound: overload must exhaust the worker while the router stays well inside its CPU
(its front door, router/policy/door.py, ranks tenants too, but refusing there still costs gRPC's per-call
work; bench/two_tenant_overload.py is the router-bound experiment). A rate fixed in req/s would not keep
that on a slower core, so the time scale s is calibrated at the start (`calibrate`): a cluster like the
experiment's, whose worker answers at once, is driven flat out by a closed loop (bench/calibration.py), and
s is the smallest factor >= 1 that brings 3 x C down to `HEADROOM` of the rate it served. A larger s runs
the same experiment slower: the same batch sizes, the same deadline in batch times, the same loads relative
to C.

    # calibrate, both runs, compare
    python -m sluice_inference.bench.overload [--duration 20] [--scale S] [--json out.json]

The e2e test tests/e2e/test_overload.py runs the same code and asserts the promises.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from sluice_inference.bench.calibration import RouterSpeed, measure_router, one_row_request, scale_for
from sluice_inference.bench.loadgen import run_scenario
from sluice_inference.bench.loadgen_scenario import parse_scenario
from sluice_inference.bench.scratch import scratch_folder
from sluice_inference.common.child_processes import Child
from sluice_inference.common.local_cluster import free_port, start_cluster, stop_cluster
from sluice_inference.router.policy.tenants import hash_api_key
from sluice_inference.router.status import EXPORT_EVERY_S, REFRESH_S

BASE_MS, PER_ITEM_MS, MAX_BATCH = 20.0, 2.0, 8
"""t(b) at s = 1."""
DEADLINE_MS = 500.0
"""Every request's deadline at s = 1: about 14 full batches' time."""
CAPACITY_RPS = MAX_BATCH / ((BASE_MS + PER_ITEM_MS * MAX_BATCH) / 1000)
"""C at s = 1."""
GAUGE_LAG_S = EXPORT_EVERY_S + REFRESH_S
"""How long after a lane empties its depth gauge may still show requests in it: the router's status pass
exports the gauges at most once per `EXPORT_EVERY_S`, and passes come `REFRESH_S` apart. The queues are
read from that gauge, so how soon they drain is judged against the deadline plus this lag: the load
generator has every answer before the wait starts, so what the wait measures beyond the lag is a request
left queued."""
LANE_BOUND = 64
HEADROOM = 0.4
"""3 x C is at most this share of what the router path served flat out in the calibration. With admission
two thirds of it is refused, at about a sixth of the cost of serving a request, so the router spends under
a fifth of its measured capacity; as a plain FIFO, under a third. With the CPU limited to 0.8 of a core
(flat out 270-530 req/s, as the machine's other load varied), 3 x C at 0.6 x the calibrated rate kept the
e2e test green; at about 1 x, calls of the FIFO run waited at the router's front door and were refused;
at s = 1 (2.2 x) gold lost two thirds of its requests there."""
GOLD_KEY, BRONZE_KEY = "gold-key", "bronze-key"


@dataclass(frozen=True)
class Calibration:
    """The time scale s of a run and the measurement it was derived from."""

    speed: RouterSpeed | None
    """The calibration burst; None when s was given (`--scale`)."""
    scale: float

    @property
    def base_ms(self) -> float:
        """The synthetic model's time per forward."""
        return BASE_MS * self.scale

    @property
    def per_item_ms(self) -> float:
        """The synthetic model's time per row."""
        return PER_ITEM_MS * self.scale

    @property
    def deadline_ms(self) -> float:
        """Every request's deadline."""
        return DEADLINE_MS * self.scale

    @property
    def drain_bound_s(self) -> float:
        """How soon after the last answer the lanes' gauge must read empty: the deadline (nothing queued
        outlives its own) plus the gauge's `GAUGE_LAG_S`."""
        return self.deadline_ms / 1000 + GAUGE_LAG_S

    @property
    def capacity_rps(self) -> float:
        """C: full batches back to back."""
        return CAPACITY_RPS / self.scale

    @property
    def offered_rps(self) -> float:
        """3 x C, gold and bronze together."""
        return 3 * self.capacity_rps

    @property
    def router_cores(self) -> float | None:
        """The router's CPU at 3 x C, in cores, were every request served at the calibration's cost (an
        upper bound: refusals cost less)."""
        return None if self.speed is None else self.offered_rps * self.speed.router_cpu_ms / 1000

    def summary(self) -> dict[str, float | None]:
        """The figures a report records."""
        return {
            "router_path_rps": None if self.speed is None else self.speed.rps,
            "router_cpu_ms_per_request": None if self.speed is None else self.speed.router_cpu_ms,
            "router_cores_at_3c_at_most": self.router_cores,
            "scale": self.scale,
            "base_ms": self.base_ms,
            "per_item_ms": self.per_item_ms,
            "capacity_rps": self.capacity_rps,
            "gold_rps": self.capacity_rps / 2,
            "bronze_rps": 2.5 * self.capacity_rps,
            "deadline_ms": self.deadline_ms,
        }

    def describe(self) -> str:
        """Two lines for the output: what was measured and what was derived."""
        measured = "time scale given, not calibrated" if self.speed is None else self.speed.describe()
        derived = (
            f"s = {self.scale:.2f}: t(b) = {self.base_ms:.1f} ms + {self.per_item_ms:.2f} ms·b, "
            f"C ≈ {self.capacity_rps:.0f} req/s, gold {self.capacity_rps / 2:.0f} + bronze "
            f"{2.5 * self.capacity_rps:.0f} req/s offered, deadline {self.deadline_ms:.0f} ms"
        )
        if self.speed is not None and self.router_cores is not None:
            derived += f"; 3 x C = {self.offered_rps / self.speed.rps:.0%} of the router path, "
            derived += f"router CPU at most {self.router_cores:.0%} of a core"
        return f"calibration: {measured}\n{derived}"


def write_repository(root: Path, base_ms: float, per_item_ms: float) -> Path:
    """A model repository holding only this experiment's `synthetic` model, at the given speed."""
    folder = root / "synthetic"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    config = {
        "name": "synthetic",
        "description": f"simulated device: t(b) = {base_ms:g} ms + {per_item_ms:g} ms * b (sleeps), for the "
        "overload experiment",
        "backend": "synthetic",
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [16]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [16]}],
        "max_batch_size": MAX_BATCH,
        "deterministic": True,
        "batching": {"max_wait_ms": 2.0},
        "synthetic": {"base_ms": base_ms, "per_item_ms": per_item_ms},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root


def gold_and_bronze(quota: dict[str, int]) -> dict[str, Any]:
    """The overload benches' two tenants: gold at priority 1 and bronze at 3, each with `quota` (rate,
    burst, max_inflight)."""
    return {
        "gold": {**quota, "api_keys": [hash_api_key(GOLD_KEY)], "default_priority": 1, "max_priority": 1},
        "bronze": {**quota, "api_keys": [hash_api_key(BRONZE_KEY)], "default_priority": 3, "max_priority": 3},
    }


def write_yaml(path: Path, config: dict[str, Any]) -> Path:
    """Write a sluice.yaml (its folder made) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def write_config(path: Path, *, admission: bool) -> Path:
    """sluice.yaml: the two tenants, and admission on (bounded lanes) or off (the unbounded FIFO)."""
    return write_yaml(
        path,
        {
            "admission": {"enabled": admission, "lane_max_queued": LANE_BOUND},
            "tenants": gold_and_bronze({"rate": 100_000, "burst": 10_000, "max_inflight": 100_000}),
        },
    )


def scenario(target: str, duration_s: float, calibration: Calibration) -> dict[str, Any]:
    """3 x C: gold 1/6 of it and bronze 5/6."""
    common = {"model": "synthetic", "deadline_ms": calibration.deadline_ms, "rows": 1}
    return {
        "target": target,
        "duration_s": duration_s,
        "rate": calibration.offered_rps,
        "arrivals": {"process": "poisson"},
        "seed": 3,
        "channels": 4,
        "classes": [
            {
                "name": "gold",
                "weight": 1,
                "tenant_key": GOLD_KEY,
                "tenant": "gold",
                "priority": 1,
                **common,
            },
            {
                "name": "bronze",
                "weight": 5,
                "tenant_key": BRONZE_KEY,
                "tenant": "bronze",
                "priority": 3,
                **common,
            },
        ],
    }


@dataclass
class Sampler:
    """Polls the router's /metrics and /proc while the load runs."""

    metrics_port: int
    router_pid: int
    max_lane_depth: float = 0.0
    rss_mb: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def lane_depth(self) -> float:
        """Deepest lane now."""
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).read().decode()
        )
        for family in text_string_to_metric_families(text):
            if family.name == "sluice_router_lane_depth":
                return max((s.value for s in family.samples), default=0.0)
        return 0.0

    def rss(self) -> float:
        """Router resident memory, MB."""
        for line in Path(f"/proc/{self.router_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def run(self) -> None:
        """Sample every 0.2 s until stopped."""
        while not self._stop.wait(0.2):
            self.max_lane_depth = max(self.max_lane_depth, self.lane_depth())
            self.rss_mb.append(self.rss())

    def stop(self) -> None:
        """End the sampling loop."""
        self._stop.set()


@dataclass(frozen=True)
class Cluster:
    """A started local cluster: where it listens and its processes."""

    port: int
    metrics_port: int
    router: Child
    worker: Child
    etcd: Child


@contextlib.contextmanager
def running_cluster(workdir: Path, repository: Path, config: Path) -> Iterator[Cluster]:
    """A started cluster configured by `config` with one worker serving `repository`; stopped on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(
        etcd_port=free_port(), port=free_port(), metrics_port=free_port(), config=config, workers=1,
        repository=repository, ready_timeout=120.0,
    )  # fmt: skip
    children: list[Child] = []
    data_dir = Path(tempfile.mkdtemp(prefix="sluice-etcd-", dir=workdir))
    try:
        (workdir / "logs").mkdir(exist_ok=True)
        start_cluster(args, data_dir, workdir / "logs", children, threading.Event())
        named = {c.name: c for c in children}
        yield Cluster(args.port, args.metrics_port, named["router"], named["worker-1"], named["etcd"])
    finally:
        stop_cluster(children)


def calibrate(workdir: Path) -> Calibration:
    """Measure the router path flat out on a cluster like the experiment's (admission on, gold's key)
    whose worker answers at once, and derive the time scale s from it (see the module docstring)."""
    repository = write_repository(workdir / "models", base_ms=0.0, per_item_ms=0.0)
    config = write_config(workdir / "sluice.yaml", admission=True)
    with running_cluster(workdir, repository, config) as cluster:
        speed = gold_flat_out(cluster)
    return Calibration(speed, scale_for(3 * CAPACITY_RPS, speed.rps, HEADROOM))


def gold_flat_out(cluster: Cluster) -> RouterSpeed:
    """The cluster's router path flat out: gold's one-row `synthetic` requests (bench/calibration.py)."""
    return asyncio.run(
        measure_router(
            f"127.0.0.1:{cluster.port}",
            one_row_request("synthetic"),
            router_pid=cluster.router.process.pid,
            metadata=(("authorization", f"Bearer {GOLD_KEY}"),),
        )
    )


def run_once(
    *, admission: bool, duration_s: float, workdir: Path, calibration: Calibration
) -> dict[str, Any]:
    """Start a cluster, offer 3 x C for `duration_s`, and return the load report plus router figures."""
    repository = write_repository(workdir / "models", calibration.base_ms, calibration.per_item_ms)
    config = write_config(workdir / "sluice.yaml", admission=admission)
    with running_cluster(workdir, repository, config) as cluster:
        port = cluster.port
        sampler = Sampler(cluster.metrics_port, cluster.router.process.pid)
        rss_before = sampler.rss()
        thread = threading.Thread(target=sampler.run, daemon=True)
        thread.start()
        load = parse_scenario(scenario(f"127.0.0.1:{port}", duration_s, calibration))
        report = asyncio.run(run_scenario(load))
        finished = time.monotonic()
        while sampler.lane_depth() and time.monotonic() - finished < calibration.drain_bound_s:
            time.sleep(0.02)
        drained_s = time.monotonic() - finished
        sampler.stop()
        thread.join()
        report["router"] = {
            "admission": admission,
            "calibration": calibration.summary(),
            "capacity_rps": calibration.capacity_rps,
            "lane_bound": LANE_BOUND if admission else None,
            "max_lane_depth": sampler.max_lane_depth,
            "queues_empty_after_s": drained_s,
            "queues_empty": sampler.lane_depth() == 0,
            "rss_mb_before": rss_before,
            "rss_mb_peak": max(sampler.rss_mb, default=rss_before),
            "rss_mb_after": sampler.rss(),
        }
        return report


def _class(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in report["classes"] if c["name"] == name)


def comparison_table(runs: dict[str, dict[str, Any]]) -> str:
    """Markdown: offered vs goodput per tenant, p99 of admitted, shed rate, with and without admission."""
    lines = [
        "| run | tenant | offered req/s | goodput req/s | goodput % | p99 OK ms | rejected % "
        "| with hint % | late OK |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, report in runs.items():
        for name in ("gold", "bronze"):
            c = _class(report, name)
            offered = max(1, c["offered"])
            p99 = c["latency_ms"]["p99"]
            hint = 100 * c["rejected_with_hint"] / max(1, c["rejected"])
            lines.append(
                f"| {label} | {name} | {c['offered_rps']:.0f} | {c['goodput_rps']:.0f} | "
                f"{100 * c['good'] / offered:.1f} | {'-' if p99 is None else f'{p99:.0f}'} | "
                f"{100 * c['rejected'] / offered:.1f} | {hint:.0f} | {c['late_ok']} |"
            )
    for label, report in runs.items():
        r = report["router"]
        lines.append("")
        lines.append(
            f"{label}: deepest lane {r['max_lane_depth']:.0f} (bound {r['lane_bound']}), router RSS "
            f"{r['rss_mb_before']:.0f} → peak {r['rss_mb_peak']:.0f} MB, queues empty "
            f"{r['queues_empty_after_s'] * 1000:.0f} ms after the last answer (by their gauge, which lags by "
            f"up to {GAUGE_LAG_S * 1000:.0f} ms)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Calibrate, run with and without admission, and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per run (default 20)")
    parser.add_argument(
        "--scale",
        type=float,
        help="time scale s >= 1 to use instead of calibrating it (1: the documented run)",
    )
    parser.add_argument("--json", type=Path, help="write both reports here")
    args = parser.parse_args(argv)
    if args.scale is not None and args.scale < 1:
        parser.error("--scale must be at least 1")
    with scratch_folder("sluice-overload-") as workdir:
        calibration = (
            calibrate(workdir / "calibration") if args.scale is None else Calibration(None, args.scale)
        )
        print(calibration.describe(), flush=True)
        runs = {
            "admission": run_once(
                admission=True, duration_s=args.duration, workdir=workdir / "on", calibration=calibration
            ),
            "plain FIFO": run_once(
                admission=False, duration_s=args.duration, workdir=workdir / "off", calibration=calibration
            ),
        }
        print(f"\n{calibration.describe()}")
        print(f"offered 3 x C for {args.duration:g} s each\n")
        print(comparison_table(runs))
        if args.json:
            args.json.write_text(json.dumps(runs, indent=2))
        return 0


if __name__ == "__main__":
    sys.exit(main())
