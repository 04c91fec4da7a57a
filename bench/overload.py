"""The overload experiment (issue 3): 3 x capacity on a real local cluster, with and without admission.

A local cluster (`sluice up`, one worker) serves a `synthetic` model whose simulated device time is
t(b) = 20 ms + 2 ms·b with batches of up to 8, so its capacity is C = 8 / 36 ms ≈ 222 req/s. Tenant `gold`
(priority 1) offers 0.5 x C and `bronze` (priority 3) 2.5 x C, open-loop, every request with a 500 ms
deadline. While the load runs, the router's /metrics are sampled (deepest lane, resident memory); after
it, we check that the queues are empty within one deadline.

    python -m bench.overload [--duration 20] [--json out.json]      # both runs, then a comparison

The e2e test tests/e2e/test_overload.py runs the same code and asserts the promises.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import run_scenario
from bench.loadgen_scenario import parse_scenario
from common.local_cluster import Child, free_port, start_cluster, stop_cluster
from router.policy.tenants import hash_api_key

BASE_MS, PER_ITEM_MS, MAX_BATCH = 20.0, 2.0, 8
CAPACITY_RPS = MAX_BATCH / ((BASE_MS + PER_ITEM_MS * MAX_BATCH) / 1000)
DEADLINE_MS = 500
LANE_BOUND = 64


def write_repository(root: Path) -> Path:
    """A model repository holding only the slow `synthetic` model of this experiment."""
    folder = root / "synthetic"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    config = {
        "name": "synthetic",
        "description": "simulated device: t(b) = 20 ms + 2 ms * b (sleeps), for the overload experiment",
        "backend": "synthetic",
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [16]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [16]}],
        "max_batch_size": MAX_BATCH,
        "deterministic": True,
        "batching": {"max_wait_ms": 2.0},
        "synthetic": {"base_ms": BASE_MS, "per_item_ms": PER_ITEM_MS},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root


def write_config(path: Path, *, admission: bool) -> Path:
    """sluice.yaml: the two tenants, and admission on (bounded lanes) or off (the unbounded FIFO)."""
    tenant = {"rate": 100_000, "burst": 10_000, "max_inflight": 100_000}
    config = {
        "admission": {"enabled": admission, "lane_max_queued": LANE_BOUND},
        "tenants": {
            "gold": {
                **tenant,
                "api_keys": [hash_api_key("gold-key")],
                "default_priority": 1,
                "max_priority": 1,
            },
            "bronze": {
                **tenant,
                "api_keys": [hash_api_key("bronze-key")],
                "default_priority": 3,
                "max_priority": 3,
            },
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def scenario(target: str, duration_s: float, rate: float) -> dict[str, Any]:
    """gold 1/6 and bronze 5/6 of `rate`."""
    common = {"model": "synthetic", "deadline_ms": DEADLINE_MS, "rows": 1}
    return {
        "target": target,
        "duration_s": duration_s,
        "rate": rate,
        "arrivals": {"process": "poisson"},
        "seed": 3,
        "channels": 4,
        "classes": [
            {
                "name": "gold",
                "weight": 1,
                "tenant_key": "gold-key",
                "tenant": "gold",
                "priority": 1,
                **common,
            },
            {
                "name": "bronze",
                "weight": 5,
                "tenant_key": "bronze-key",
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


def run_once(*, admission: bool, duration_s: float, workdir: Path) -> dict[str, Any]:
    """Start a cluster, offer 3 x C for `duration_s`, and return the load report plus router figures."""
    workdir.mkdir(parents=True, exist_ok=True)
    repository = write_repository(workdir / "models")
    config = write_config(workdir / "sluice.yaml", admission=admission)
    args = argparse.Namespace(
        etcd_port=free_port(), port=free_port(), metrics_port=free_port(), config=config, workers=1,
        repository=repository, ready_timeout=120.0,
    )  # fmt: skip
    children: list[Child] = []
    data_dir = Path(tempfile.mkdtemp(prefix="sluice-etcd-", dir=workdir))
    try:
        (workdir / "logs").mkdir(exist_ok=True)
        start_cluster(args, data_dir, workdir / "logs", children, threading.Event())
        router = next(c for c in children if c.name == "router")
        sampler = Sampler(args.metrics_port, router.process.pid)
        rss_before = sampler.rss()
        thread = threading.Thread(target=sampler.run, daemon=True)
        thread.start()
        rate = 3 * CAPACITY_RPS
        load = parse_scenario(scenario(f"127.0.0.1:{args.port}", duration_s, rate))
        report = asyncio.run(run_scenario(load))
        finished = time.monotonic()
        while sampler.lane_depth() and time.monotonic() - finished < DEADLINE_MS / 1000:
            time.sleep(0.02)
        drained_s = time.monotonic() - finished
        sampler.stop()
        thread.join()
        report["router"] = {
            "admission": admission,
            "capacity_rps": CAPACITY_RPS,
            "lane_bound": LANE_BOUND if admission else None,
            "max_lane_depth": sampler.max_lane_depth,
            "queues_empty_after_s": drained_s,
            "queues_empty": sampler.lane_depth() == 0,
            "rss_mb_before": rss_before,
            "rss_mb_peak": max(sampler.rss_mb, default=rss_before),
            "rss_mb_after": sampler.rss(),
        }
        return report
    finally:
        stop_cluster(children)


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
            f"{r['queues_empty_after_s'] * 1000:.0f} ms after the last answer"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run with and without admission and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per run (default 20)")
    parser.add_argument("--json", type=Path, help="write both reports here")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-overload-"))
    runs = {
        "admission": run_once(admission=True, duration_s=args.duration, workdir=workdir / "on"),
        "plain FIFO": run_once(admission=False, duration_s=args.duration, workdir=workdir / "off"),
    }
    print(f"capacity C ≈ {CAPACITY_RPS:.0f} req/s; offered 3 x C for {args.duration:g} s each\n")
    print(comparison_table(runs))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
