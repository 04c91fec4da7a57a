"""Sluice end to end for the GPU kit: open-loop steps from the project's load generator
(bench/loadgen.py), each with what the routers and the device did meanwhile: the mean batch the routers
formed (from their /metrics), the routers' CPU (from /proc, all their processes), and the device's
utilisation (NVML, when there is one).

One step is one `run_scenario` at one rate: arrivals fixed in advance, no retries, every request one
outcome; goodput counts answers OK within the class deadline, which is the step's SLO.
"""

from __future__ import annotations

import asyncio
import os
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sluice_inference.bench.loadgen import run_scenario
from sluice_inference.bench.loadgen_scenario import parse_scenario

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
NVML_PERIOD_S = 0.1


@dataclass(frozen=True)
class Load:
    """What one step offers: `rate` requests/s of one row of tokens, lengths drawn from `lengths`."""

    target: str
    model: str
    rate: float
    duration_s: float
    deadline_ms: float
    lengths: list[int]
    channels: int = 8
    seed: int = 0


def run_load(load: Load) -> dict[str, Any]:
    """The load generator's report of one step (bench/loadgen_stats.py)."""
    scenario = parse_scenario(
        {
            "target": load.target, "duration_s": load.duration_s, "rate": load.rate, "seed": load.seed,
            "channels": load.channels,
            "classes": [{"name": load.model, "model": load.model, "deadline_ms": load.deadline_ms,
                         "length": load.lengths, "payloads": 16}],
        }
    )  # fmt: skip
    return asyncio.run(run_scenario(scenario))


def tree_pids(root: int) -> list[int]:
    """`root` and every descendant still running (the routers' supervisor and its router processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (ones that exited count 0)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def pin(pids: list[int], cores: list[int]) -> None:
    """Keep the processes, every thread of them, on `cores` (the routers and the load generator on cores
    of their own); a thread inherits its creator's mask, but gRPC's and torch's already run."""
    for pid in pids:
        try:
            threads = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
        except FileNotFoundError:
            continue  # exited
        for tid in threads:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:
                continue


def batch_totals(metrics_ports: list[int], model: str) -> tuple[float, float]:
    """Batches sent and rows in them, for `model`, summed over the routers' /metrics."""
    batches = rows = 0.0
    for port in metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name != "sluice_router_batch_size":
                continue
            for sample in family.samples:
                if sample.labels.get("model") != model:
                    continue
                if sample.name.endswith("_count"):
                    batches += sample.value
                elif sample.name.endswith("_sum"):
                    rows += sample.value
    return batches, rows


class NvmlSampler:
    """Mean GPU utilisation over a window, sampled every NVML_PERIOD_S on a thread; None without NVML."""

    def __init__(self, nvml: Any, index: int) -> None:
        nvml.nvmlInit()
        self._nvml = nvml
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)

    @classmethod
    def create(cls, device: str) -> NvmlSampler | None:
        """A sampler for `cuda:N`, or None (CPU, or no NVML here: the reason is printed)."""
        if not device.startswith("cuda"):
            return None
        try:
            import pynvml
        except ImportError:
            print("nvidia-ml-py is not installed: no GPU utilisation figures", flush=True)
            return None
        try:
            return cls(pynvml, int(device.partition(":")[2] or 0))
        except pynvml.NVMLError as exc:
            print(f"NVML unavailable ({exc}): no GPU utilisation figures", flush=True)
            return None

    @contextmanager
    def window(self) -> Iterator[dict[str, float]]:
        """Sample while the block runs; the dict gets `gpu_util_mean` (0-1) and `gpu_memory_used_max`."""
        figures: dict[str, float] = {}
        stop = threading.Event()
        samples: list[tuple[float, float]] = []

        def sample() -> None:
            while not stop.wait(NVML_PERIOD_S):
                rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
                memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
                samples.append((rates.gpu / 100.0, float(memory.used)))

        thread = threading.Thread(target=sample, name="nvml", daemon=True)
        thread.start()
        try:
            yield figures
        finally:
            stop.set()
            thread.join()
            if samples:
                figures["gpu_util_mean"] = sum(u for u, _ in samples) / len(samples)
                figures["gpu_memory_used_max"] = max(m for _, m in samples)


@dataclass
class Fleet:
    """Where the routers are: their client address, their /metrics ports and their supervisor's pid."""

    target: str
    metrics_ports: list[int]
    router_pid: int


def measured_step(fleet: Fleet, load: Load, nvml: NvmlSampler | None) -> dict[str, Any]:
    """One open-loop step with the routers' batches and CPU and the device's utilisation around it."""
    routers = tree_pids(fleet.router_pid)
    batches0, rows0 = batch_totals(fleet.metrics_ports, load.model)
    cpu0 = cpu_seconds(routers)
    figures: dict[str, float] = {}
    if nvml is None:
        report = run_load(load)
    else:
        with nvml.window() as figures:
            report = run_load(load)
    cpu = cpu_seconds(routers) - cpu0
    batches1, rows1 = batch_totals(fleet.metrics_ports, load.model)
    total = report["total"]
    batches = batches1 - batches0
    return {
        "model": load.model, "rate": load.rate, "duration_s": load.duration_s, "slo_ms": load.deadline_ms,
        "offered": total["offered"], "ok": total["ok"], "good": total["good"],
        "goodput_rps": total["goodput_rps"], "throughput_rps": total["throughput_rps"],
        "p50_ms": total["latency_ms"]["p50"], "p99_ms": total["latency_ms"]["p99"],
        "rejected_by_status": total["rejected_by_status"],
        "mean_batch": (rows1 - rows0) / batches if batches else None, "batches": batches,
        "router_cpu_s": cpu, "router_cpu_ms_per_ok": 1000.0 * cpu / total["ok"] if total["ok"] else None,
        "send_lag_p99_ms": report["send_lag_ms"]["p99"], "warnings": report["warnings"], **figures,
    }  # fmt: skip
