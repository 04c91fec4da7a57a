"""Router CPU per served request and per front-door refusal, at one open-loop rate (issue 17: refusing must
cost at most a third of serving).

Two fresh local clusters (`sluice up`, one worker whose `synthetic` model answers at once) take the same
Poisson load from this process, one tenant:

- *served*: the door off, every request served: router CPU seconds / OK answers;
- *refused*: the door's bound at 1 µs with no sustain time, so it closes on the first sample and stays at
  its floor (1 % admitted): router CPU seconds / requests, nearly all refused before their body is parsed.
  The door's own probe (20 calls a second while it is closed) is part of that cost.

The router's and the worker's CPU come from /proc over the load's window (etcd's is not counted: it is
the same, a few lease renewals, in both runs). Serving costs the router and the worker; a refusal only the
router, so the ratio is given both ways. With `--profile DIR`, py-spy samples the router
in both runs (on-CPU only: `--nonblocking`, idle threads are not sampled as running) and the stage
breakdown of bench/cpu_breakdown.py is printed per run.

    python -m sluice_inference.bench.router_cost [--rate 300] [--duration 10] [--profile /tmp/prof]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import yaml

from sluice_inference.bench.calibration import process_cpu_s
from sluice_inference.bench.cpu_breakdown import table
from sluice_inference.bench.loadgen import run_scenario
from sluice_inference.bench.loadgen_scenario import parse_scenario
from sluice_inference.bench.overload import running_cluster, write_repository
from sluice_inference.bench.scratch import scratch_folder
from sluice_inference.router.policy.tenants import hash_api_key

KEY = "bench-key"
WARMUP_S = 2.0
"""Load before the measured window: first calls, estimates and the door's first cut are over by then."""


def write_config(path: Path, *, door_closed: bool) -> Path:
    """One tenant with quotas far above the load; the door off, or closed from the first sample on."""
    door = {"door_max_delay_ms": 0.001, "door_sustain_s": 0.0} if door_closed else {"door_max_delay_ms": 0}
    tenant = {"rate": 1_000_000, "burst": 100_000, "max_inflight": 1_000_000, "api_keys": [hash_api_key(KEY)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"router": door, "tenants": {"bench": tenant}}))
    return path


def scenario(target: str, rate: float, duration_s: float) -> dict[str, Any]:
    """Poisson one-row requests past the cache, a 1 s deadline."""
    return {
        "target": target,
        "duration_s": duration_s,
        "rate": rate,
        "arrivals": {"process": "poisson"},
        "seed": 5,
        "channels": 4,
        "classes": [
            {
                "name": "load",
                "tenant_key": KEY,
                "model": "synthetic",
                "deadline_ms": 1000,
                "rows": 1,
                "cache": False,
            }
        ],
    }


def measure(
    workdir: Path,
    repository: Path,
    *,
    door_closed: bool,
    rate: float,
    duration_s: float,
    profile: Path | None,
) -> dict[str, Any]:
    """One run: router CPU over the window after `WARMUP_S`, OK answers and refusals in the whole load."""
    config = write_config(workdir / "sluice.yaml", door_closed=door_closed)
    with running_cluster(workdir, repository, config) as cluster:
        pid, worker = cluster.router.process.pid, cluster.worker.process.pid
        load = parse_scenario(scenario(f"127.0.0.1:{cluster.port}", rate, WARMUP_S + duration_s))

        async def run() -> tuple[dict[str, Any], float, float]:
            task = asyncio.create_task(run_scenario(load))
            await asyncio.sleep(WARMUP_S)
            before, worker_before = process_cpu_s(pid), process_cpu_s(worker)
            spy = None
            if profile is not None:
                raw = profile / ("refused.raw" if door_closed else "served.raw")
                spy = await asyncio.create_subprocess_exec(
                    str(Path(sys.executable).parent / "py-spy"), "record", "--nonblocking", "--rate", "250",
                    "--format", "raw", "-d", str(int(duration_s)), "-p", str(pid), "-o", str(raw),
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                )  # fmt: skip
            await asyncio.sleep(duration_s)
            cpu, worker_cpu = process_cpu_s(pid) - before, process_cpu_s(worker) - worker_before
            if spy is not None:
                await spy.wait()
            return await task, cpu, worker_cpu

        report, cpu_s, worker_s = asyncio.run(run())
    total = report["total"]
    window_requests = rate * duration_s
    return {
        "ok": total["ok"],
        "refused": total["rejected_by_status"].get("UNAVAILABLE/router_overloaded", 0),
        "offered": total["offered"],
        "router_cpu_s": cpu_s,
        "router_ms_per_request": 1000 * cpu_s / window_requests,
        "router_cores": cpu_s / duration_s,
        "worker_ms_per_request": 1000 * worker_s / window_requests,
    }


def main(argv: list[str] | None = None) -> int:
    """Both runs, then the two costs and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=300.0, help="offered req/s (default 300)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run (default 10)")
    parser.add_argument("--profile", type=Path, help="write py-spy raw samples here and print the breakdown")
    args = parser.parse_args(argv)
    with scratch_folder("sluice-router-cost-") as workdir:
        repository = write_repository(workdir / "models", base_ms=0.0, per_item_ms=0.0)
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        runs = {
            name: measure(
                workdir / name, repository, door_closed=name == "refused", rate=args.rate,
                duration_s=args.duration, profile=args.profile,
            )
            for name in ("served", "refused")
        }  # fmt: skip
        for name, run in runs.items():
            print(
                f"{name}: {args.rate:g} req/s offered, {run['ok']} OK and {run['refused']} refused of "
                f"{run['offered']}; router {run['router_cores']:.2f} cores, "
                f"{run['router_ms_per_request']:.3f} ms CPU per request "
                f"(worker {run['worker_ms_per_request']:.3f})"
            )
        served, refused = runs["served"], runs["refused"]
        router_ratio = refused["router_ms_per_request"] / served["router_ms_per_request"]
        whole = served["router_ms_per_request"] + served["worker_ms_per_request"]
        refusal_whole = refused["router_ms_per_request"] + refused["worker_ms_per_request"]
        whole_ratio = refusal_whole / whole
        print(f"refusal / serving: {router_ratio:.2f} in the router, {whole_ratio:.2f} router + worker")
        if args.profile is not None:
            for name, run in runs.items():
                print(f"\n{name}:")
                requests = round(args.rate * args.duration)
                print(table([args.profile / f"{name}.raw"], [run["router_cpu_s"]], requests))
        return 0


if __name__ == "__main__":
    sys.exit(main())
