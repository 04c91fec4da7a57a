"""CPU per request of the router and the worker at a fixed offered rate, and the mean rows per batch: the
figures to fit CPU per request = c0 + c1 / rows (issue 17; docs/performance.md, "The hop").

Starts `sluice up`'s cluster (etcd, one router, one worker on the demo models) on free ports, sends
requests of one row at `--rate` per second, open loop, from this process (its own CPU is not counted),
and after `--warmup` seconds reads over `--seconds` each process's CPU time from /proc (user + system,
every thread), the requests answered OK in that window, and the rows per batch the router sent (its
/metrics). Requests bypass the result cache.

Rows per batch follow from the rate and how long a forward takes (the router sends as soon as the worker
is free, so arrivals during a forward make the next batch): `--model synthetic` sleeps `--base-ms` per
forward (its config is rewritten in the repository this run uses) and spends no CPU on it, so the
worker's CPU is all overhead; `--model mlp` runs the real demo MLP.

    python -m sluice_inference.bench.hop_cpu --model synthetic --base-ms 1 --rate 300    # ~1.5 rows
    python -m sluice_inference.bench.hop_cpu --model synthetic --base-ms 30 --rate 300   # ~10 rows

Run it beside other work and the figures move: compare rows from one sitting, and repeat points.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

from sluice_inference.bench.idle_cpu import cpu_seconds
from sluice_inference.bench.scratch import scratch_folder
from sluice_inference.common.child_processes import Child
from sluice_inference.common.local_cluster import free_port, start_cluster, stop_cluster
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.worker.demo_models import init_demo_repository

POOL = 64
"""Distinct requests sent in turn (the cache is bypassed, so repeats cost the same as new inputs)."""


INPUTS = {"mlp": ("input", 256), "synthetic": ("x", 16)}
"""Each model's one input and its width."""


def _requests(model: str, rng: np.random.Generator) -> list[kserve.ModelInferRequest]:
    name, width = INPUTS[model]
    pool = []
    for _ in range(POOL):
        request = kserve.ModelInferRequest(model_name=model)
        request.inputs.add(name=name, datatype="FP32", shape=[1, width])
        request.raw_input_contents.append(rng.standard_normal((1, width)).astype("<f4").tobytes())
        request.parameters["cache"].bool_param = False
        pool.append(request)
    return pool


def _batch_rows(metrics_port: int) -> tuple[float, float]:
    """(sum, count) of the router's rows-per-batch histogram."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "sluice_router_batch_size":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


async def _drive(
    port: int, model: str, *, rate: float, warmup_s: float, seconds: float, on_window: Any
) -> tuple[int, int]:
    """Send at `rate` for warmup + seconds; call `on_window(start|end)` around the measured window; the
    requests answered OK and failed within it."""
    pool = _requests(model, np.random.default_rng(0))
    counts = {"ok": 0, "failed": 0}
    window = {"open": False}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)

        async def one(request: kserve.ModelInferRequest) -> None:
            try:
                await stub.ModelInfer(request, timeout=2.0)
                outcome = "ok"
            except grpc.aio.AioRpcError:
                outcome = "failed"
            if window["open"]:
                counts[outcome] += 1

        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks: set[asyncio.Task[None]] = set()
        total = int(rate * (warmup_s + seconds))
        for index in range(total):
            due = start + index / rate
            if not window["open"] and due >= start + warmup_s:
                on_window("start")
                window["open"] = True
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(pool[index % POOL]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(max(0.0, start + warmup_s + seconds - loop.time()))
        window["open"] = False
        on_window("end")
        await asyncio.gather(*tasks, return_exceptions=True)
    return counts["ok"], counts["failed"]


def _repository(args: argparse.Namespace, workdir: Path) -> Path:
    repository: Path = args.repository or workdir / "models"
    if not (repository / "mlp").exists():
        init_demo_repository(repository)
    config_path = repository / "synthetic" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["synthetic"]["base_ms"] = args.base_ms
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return repository


def main(argv: list[str] | None = None) -> int:
    """Start a cluster, drive it at one rate, print CPU per request of each process and rows per batch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second (default 200)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured window (default 15)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before the window (default 3)")
    parser.add_argument("--model", choices=sorted(INPUTS), default="synthetic")
    parser.add_argument("--base-ms", type=float, default=1.0, help="synthetic: ms per forward (default 1)")
    parser.add_argument("--repository", type=Path, help="model repository (default: fresh demo models)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    with scratch_folder("sluice-hop-") as workdir:
        repository = _repository(args, workdir)
        cluster = argparse.Namespace(
            etcd_port=free_port(), port=free_port(), metrics_port=free_port(), config=None, workers=1,
            repository=repository, ready_timeout=180.0,
        )  # fmt: skip
        children: list[Child] = []
        marks: dict[str, Any] = {}

        def on_window(edge: str) -> None:
            marks[edge] = (
                {c.name: cpu_seconds(c.process.pid) for c in children},
                _batch_rows(cluster.metrics_port),
                time.monotonic(),
            )

        try:
            (workdir / "data").mkdir()
            start_cluster(cluster, workdir / "data", workdir, children, threading.Event())
            drive = _drive(
                cluster.port, args.model, rate=args.rate, warmup_s=args.warmup, seconds=args.seconds,
                on_window=on_window,
            )  # fmt: skip
            ok, failed = asyncio.run(drive)
        finally:
            stop_cluster(children)
        (cpu0, rows0, t0), (cpu1, rows1, t1) = marks["start"], marks["end"]
        batches = rows1[1] - rows0[1]
        figures: dict[str, Any] = {
            "model": args.model, "rate": args.rate,
            "base_ms": args.base_ms if args.model == "synthetic" else None,
            "seconds": round(t1 - t0, 2), "ok": ok, "failed": failed,
            "rows_per_batch": round((rows1[0] - rows0[0]) / batches, 2) if batches else 0.0,
            "cpu_ms_per_request": {
                name: round(1000 * (cpu1[name] - cpu0[name]) / max(ok, 1), 3)
                for name in cpu0 if name != "etcd"
            },
        }  # fmt: skip
        print(json.dumps(figures))
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
        return 0


if __name__ == "__main__":
    sys.exit(main())
