"""Figures for the result cache (docs/caching.md), on a real local cluster with a real Redis (Valkey).

1. hit ratio, hit vs miss latency and throughput for `mlp` under a Zipf-distributed input mix (s = 1.1
   over 2,000 distinct inputs), open loop, cache on — and the same load with `parameters["cache"]=false`;
2. the Redis round trip: `ResultCacheStore.get` served from the router's memory vs from Redis alone.

    python -m sluice_inference.bench.cache_figures [--rate 600] [--duration 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from sluice_inference.bench.loadgen import run_scenario
from sluice_inference.bench.loadgen_scenario import parse_scenario
from sluice_inference.bench.scratch import scratch_folder
from sluice_inference.common.child_processes import Child
from sluice_inference.common.local_cluster import free_port, start_cluster, stop_cluster
from sluice_inference.router.policy.sealing import SealKeys
from sluice_inference.router.stores.cache_store import ResultCacheStore
from sluice_inference.router.stores.redis_conn import RedisOptions, open_redis
from sluice_inference.worker.demo_models import init_demo_repository


def scenario(target: str, rate: float, duration_s: float, *, cache: bool) -> dict[str, Any]:
    """mlp with Zipf-popular inputs."""
    mix = {"model": "mlp", "deadline_ms": 1000, "rows": 1, "payloads": 2000, "zipf": 1.1, "cache": cache}
    return {
        "target": target, "duration_s": duration_s, "rate": rate, "arrivals": {"process": "poisson"},
        "seed": 5, "channels": 4, "classes": [{"name": "cache-on" if cache else "cache-off", **mix}],
    }  # fmt: skip


async def redis_round_trip(url: str, samples: int = 2000) -> dict[str, float]:
    """Median get latency from memory vs from Redis only (memory tier disabled), in microseconds."""
    client = open_redis(RedisOptions(url=url))
    keys = SealKeys([secrets.token_bytes(32)])  # both stores are one "cluster": they share the key
    try:
        memory = ResultCacheStore(capacity_bytes=64 << 20, ttl_s=600, redis=client, keys=keys)
        redis_only = ResultCacheStore(capacity_bytes=0, ttl_s=600, redis=client, keys=keys)
        payload = np.random.default_rng(0).bytes(64)  # ~ an mlp response
        await memory.put("k" * 64, payload, model="m", model_version="1")
        timings: dict[str, float] = {}
        for label, store in (("memory_us", memory), ("redis_us", redis_only)):
            durations = []
            for _ in range(samples):
                start = time.perf_counter()
                assert await store.get("k" * 64) is not None
                durations.append(time.perf_counter() - start)
            timings[label] = float(np.median(durations) * 1e6)
        return timings
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    """Start the cluster (with Valkey), run both mixes and the round-trip probe, print a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=600.0, help="offered requests/s (default 600)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per run (default 20)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with scratch_folder("sluice-cache-") as work:
        init_demo_repository(work / "models")
        (work / "logs").mkdir()
        cluster = argparse.Namespace(
            etcd_port=free_port(), port=free_port(), metrics_port=free_port(), redis_port=free_port(),
            config=None, workers=2, repository=work / "models", ready_timeout=120.0,
        )  # fmt: skip
        children: list[Child] = []
        try:
            start_cluster(cluster, work, work / "logs", children, threading.Event())
            target = f"127.0.0.1:{cluster.port}"
            runs = {}
            for cache in (True, False):
                load = parse_scenario(scenario(target, args.rate, args.duration, cache=cache))
                runs["cache on" if cache else "cache off"] = asyncio.run(run_scenario(load))["classes"][0]
            round_trip = asyncio.run(redis_round_trip(f"redis://127.0.0.1:{cluster.redis_port}/0"))
        finally:
            stop_cluster(children)
        _print(runs, round_trip, args.rate)
        if args.json:
            args.json.write_text(json.dumps({"runs": runs, "redis_round_trip": round_trip}, indent=2))
        return 0


def _print(runs: dict[str, dict[str, Any]], round_trip: dict[str, float], rate: float) -> None:
    on, off = runs["cache on"], runs["cache off"]
    hits = on["cache"].get("hit", {}).get("count", 0)
    print(f"mlp, {rate:g} req/s offered, Zipf(1.1) over 2,000 inputs\n")
    print("| run | throughput req/s | p50 ms | p99 ms | hit ratio | hit p50 / p99 ms | miss p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for label, c in runs.items():
        lat = c["latency_ms"]
        hit = c["cache"].get("hit", {}).get("latency_ms", {})
        miss = c["cache"].get("miss", {}).get("latency_ms", {})
        ratio = f"{100 * hits / max(1, c['ok']):.1f} %" if label == "cache on" else "-"
        print(
            f"| {label} | {c['throughput_rps']:.0f} | {lat['p50']:.2f} | {lat['p99']:.2f} | {ratio} | "
            f"{_pair(hit)} | {_pair(miss)} |"
        )
    gain = on["throughput_rps"] / max(1e-9, off["throughput_rps"])
    print(f"\nthroughput with the cache / without: {gain:.2f}x")
    print(
        f"cache get: {round_trip['memory_us']:.1f} µs from router memory, {round_trip['redis_us']:.1f} µs "
        "from Redis (median)"
    )


def _pair(latency: dict[str, Any]) -> str:
    if not latency or latency.get("p50") is None:
        return "-"
    return f"{latency['p50']:.2f} / {latency['p99']:.2f}"


if __name__ == "__main__":
    sys.exit(main())
