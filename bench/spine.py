"""Figures for the spine (issue 2), measured on a real local cluster started by `make run`.

1. the router hop: p50/p99 of sequential single requests to `mlp` through the router, vs calling the same
   model artifact in-process (one torch thread, as a worker uses);
2. saturation: closed-loop clients keep many requests in flight for a while; completed requests per second
   and the mean batch size the router formed (from its /metrics);
3. time from `make run` to "Sluice is up" on a warm machine (venv and models already there).

Everything runs on this machine, so the load generator competes with the cluster for the same cores:
compare figures from one run, not across machines.  Usage: python -m sluice_inference.bench.spine
[--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

from sluice_inference.bench.scratch import scratch_folder
from sluice_inference.common.local_cluster import free_port
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc

ROOT = Path(__file__).resolve().parent.parent


def _percentiles(samples: list[float]) -> dict[str, float]:
    ms = np.array(samples) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "n": len(samples)}


def _request(rng: np.random.Generator) -> kserve.ModelInferRequest:
    """An mlp request that bypasses the result cache: these figures measure the path to the workers (the
    saturation pool repeats 256 inputs, which would otherwise be cache hits; see bench/cache_figures.py)."""
    request = kserve.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 256])
    request.raw_input_contents.append(rng.standard_normal((1, 256)).astype("<f4").tobytes())
    request.parameters["cache"].bool_param = False
    return request


def start_cluster(ports: dict[str, int], log: Path) -> tuple[subprocess.Popen[bytes], float]:
    """`make run` on free ports; returns the process and the seconds until it printed readiness."""
    args = (
        f"--port {ports['router']} --metrics-port {ports['metrics']} --etcd-port {ports['etcd']} "
        f"--log-dir {log.parent}"
    )
    start = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["make", "--no-print-directory", "run", f"RUN_ARGS={args}"],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C is delivered to the whole group: make and `sluice up`
        )
    while b"Sluice is up" not in log.read_bytes():
        if process.poll() is not None or time.monotonic() - start > 180:
            raise RuntimeError(f"cluster did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return process, time.monotonic() - start


def hop_latency(addr: str, repository: Path, count: int) -> dict[str, Any]:
    """Sequential requests through the router vs the artifact called in-process."""
    rng = np.random.default_rng(0)
    requests = [_request(rng) for _ in range(count)]
    through: list[float] = []
    with grpc.insecure_channel(addr) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        for request in requests[:50]:
            stub.ModelInfer(request, timeout=10)  # warm the channel
        for request in requests:
            start = time.perf_counter()
            stub.ModelInfer(request, timeout=10)
            through.append(time.perf_counter() - start)
    torch.set_num_threads(1)
    module = torch.export.load(str(repository / "mlp" / "1" / "model.pt2")).module()
    local: list[float] = []
    with torch.inference_mode():
        for request in requests:
            start = time.perf_counter()
            x = np.frombuffer(request.raw_input_contents[0], "<f4").reshape(1, 256).copy()
            module(input=torch.from_numpy(x)).numpy()
            local.append(time.perf_counter() - start)
    router, direct = _percentiles(through), _percentiles(local)
    return {
        "through_router": router,
        "in_process": direct,
        "hop_overhead_p50_ms": router["p50_ms"] - direct["p50_ms"],
        "hop_overhead_p99_ms": router["p99_ms"] - direct["p99_ms"],
    }


def _batches(metrics_port: int) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "sluice_router_batch_size":
            values = {s.name: s.value for s in family.samples if s.labels.get("model") == "mlp"}
            return values.get("sluice_router_batch_size_count", 0.0), values.get(
                "sluice_router_batch_size_sum", 0.0
            )
    return 0.0, 0.0


async def _saturate(addr: str, concurrency: int, duration: float) -> tuple[int, int, float]:
    rng = np.random.default_rng(1)
    pool = [_request(rng) for _ in range(256)]
    done = failed = 0
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        stop_at = time.monotonic() + duration

        async def client(index: int) -> None:
            nonlocal done, failed
            i = index
            while time.monotonic() < stop_at:
                try:
                    await stub.ModelInfer(pool[i % len(pool)], timeout=30)
                    done += 1
                except grpc.aio.AioRpcError:
                    failed += 1
                i += concurrency

        start = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        return done, failed, time.monotonic() - start


def saturation(addr: str, metrics_port: int, concurrency: int, duration: float) -> dict[str, Any]:
    """Closed-loop load: requests/s completed with `concurrency` in flight, and the mean batch size."""
    batches0, rows0 = _batches(metrics_port)
    done, failed, elapsed = asyncio.run(_saturate(addr, concurrency, duration))
    batches1, rows1 = _batches(metrics_port)
    return {
        "concurrency": concurrency,
        "seconds": elapsed,
        "completed": done,
        "failed": failed,
        "throughput_rps": done / elapsed,
        "mean_batch_size": (rows1 - rows0) / max(1.0, batches1 - batches0),
    }


def main(argv: list[str] | None = None) -> int:
    """Start a cluster with `make run`, measure, stop it, print and optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "models")
    parser.add_argument("--requests", type=int, default=2000, help="sequential requests for the hop figure")
    parser.add_argument("--concurrency", type=int, default=128, help="requests in flight at saturation")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of saturation load")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    ports = {"router": free_port(), "metrics": free_port(), "etcd": free_port()}
    with scratch_folder("sluice-bench-") as log_dir:
        process, ready_s = start_cluster(ports, log_dir / "run.log")
        addr = f"127.0.0.1:{ports['router']}"
        try:
            figures = {
                "make_run_to_ready_s": ready_s,
                "hop": hop_latency(addr, args.repository, args.requests),
                "saturation": saturation(addr, ports["metrics"], args.concurrency, args.duration),
            }
        finally:
            os.killpg(process.pid, signal.SIGINT)
            process.wait(60)
        _print(figures)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
        return 0


def _print(f: dict[str, Any]) -> None:
    hop, sat = f["hop"], f["saturation"]
    router, local = hop["through_router"], hop["in_process"]
    rows = [
        ("make run → ready (warm machine)", f"{f['make_run_to_ready_s']:.2f} s"),
        ("mlp via router, sequential p50 / p99", f"{router['p50_ms']:.3f} / {router['p99_ms']:.3f} ms"),
        ("mlp in-process, p50 / p99", f"{local['p50_ms']:.3f} / {local['p99_ms']:.3f} ms"),
        (
            "router hop overhead p50 / p99",
            f"{hop['hop_overhead_p50_ms']:.3f} / {hop['hop_overhead_p99_ms']:.3f} ms",
        ),
        (
            f"saturation, 2 workers, {sat['concurrency']} in flight",
            f"{sat['throughput_rps']:.0f} req/s ({sat['failed']} failed)",
        ),
        ("mean batch size at saturation", f"{sat['mean_batch_size']:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"(sequential requests: {router['n']}; saturation for {sat['seconds']:.1f} s)")


if __name__ == "__main__":
    sys.exit(main())
