"""Micro-benchmark of the worker's batch runner alone (no gRPC, no router): batches/s, rows per forward, and
how often the device side wakes the event loop per batch.

S simulated router streams each keep K batches of B one-row items in flight (closed loop: a new batch as
soon as one is answered) against a `BatchRunner` on the CPU with the given capacity (batches held at once
across all streams; a batch beyond it is refused "worker_busy" and its stream sends the next one), for D
seconds. It reports rows per forward (merging shows as more rows than B) and the queue wait per batch.
Loop wake-ups are counted as `call_soon_threadsafe` calls (each one writes the loop's self-pipe: how a
thread hands work back to asyncio, e.g. a `run_in_executor` future completing), with an event loop
subclass that only counts them.

Models: `synthetic` (SIMULATED latency t(b) = a + c·b, `--profile a,c` in ms; `--profile 0,0` leaves only
the runner's own overhead) or the demo `mlp` (a real 256-1024-1024-10 forward, one torch thread).

    python -m sluice_inference.bench.worker_runner --model synthetic --streams 3 --in-flight 2 --rows 8 \
        --capacity 4
    python -m sluice_inference.bench.worker_runner --model mlp --streams 1 --in-flight 2 --rows 8 --duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sluice_inference.common.batch_tensors import pack_arrays
from sluice_inference.common.clock import MonotonicClock
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.worker.backends.synthetic import SyntheticBackend
from sluice_inference.worker.demo_models import init_demo_repository
from sluice_inference.worker.executor import Executor, LoadedModel
from sluice_inference.worker.metrics import WorkerMetrics
from sluice_inference.worker.model_config import ModelConfig
from sluice_inference.worker.repository import ModelVersionSpec, scan_repository
from sluice_inference.worker.runner import BatchRunner, StreamState


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts thread → loop hand-offs (and otherwise behaves as its base)."""

    def __init__(self) -> None:
        super().__init__()
        self.threadsafe_calls = 0

    def call_soon_threadsafe(  # type: ignore[override]  # the stub's TypeVarTuple form adds nothing here
        self, callback: Callable[..., object], *args: Any, context: contextvars.Context | None = None
    ) -> asyncio.Handle:
        """Count, then schedule as usual."""
        self.threadsafe_calls += 1
        return super().call_soon_threadsafe(callback, *args, context=context)


def load_model(name: str, profile: tuple[float, float], executor: Executor) -> LoadedModel:
    """The benchmark's model, loaded and warmed up on `executor`."""
    if name == "synthetic":
        config = ModelConfig.model_validate(
            {
                "name": "synthetic",
                "backend": "synthetic",
                "inputs": [{"name": "x", "datatype": "FP32", "dims": [16]}],
                "outputs": [{"name": "y", "datatype": "FP32", "dims": [16]}],
                "max_batch_size": 32,
                "synthetic": {"base_ms": profile[0], "per_item_ms": profile[1]},
            }
        )
        spec = ModelVersionSpec("synthetic", "1", config, None, "sha256:" + "0" * 64)
        model = LoadedModel(spec, SyntheticBackend(config, "cpu"))
    else:
        with tempfile.TemporaryDirectory(prefix="sluice-bench-models-") as folder:
            init_demo_repository(Path(folder))
            [spec] = scan_repository(Path(folder), [name])
            model = executor.load(spec)
    executor.warm_up(model)
    return model


def make_batch(model: LoadedModel, batch_id: int, rows: int, rng: np.random.Generator) -> worker_pb2.Batch:
    """A batch of `rows` one-row items of random inputs, each with a generous budget."""
    config = model.spec.config
    spec = config.inputs[0]
    x = rng.standard_normal((rows, *spec.dims)).astype("<f4")
    return worker_pb2.Batch(
        batch_id=batch_id,
        model=config.name,
        version=model.spec.version,
        item_ids=[batch_id * 1000 + index for index in range(rows)],
        item_rows=[1] * rows,
        budgets_us=[10**8] * rows,
        inputs=[pack_arrays(spec.name, [x])],
    )


async def stream_loop(
    runner: BatchRunner, model: LoadedModel, args: argparse.Namespace, until: float, seed: int
) -> dict[str, Any]:
    """One simulated router: keep `in_flight` batches outstanding until `until`; count what came back."""
    rng = np.random.default_rng(seed)
    stream = StreamState()
    counts: dict[str, Any] = {"batches": 0, "rows": 0, "refused": 0, "queue_us": []}
    next_id = 1
    outstanding = 0
    while True:
        while outstanding < args.in_flight and time.monotonic() < until:
            runner.submit([make_batch(model, next_id, args.rows, rng)], stream)
            next_id += 1
            outstanding += 1
        if outstanding == 0:
            return counts
        message = await stream.outbox.get()
        if message is None:
            continue
        for result in message.results:
            outstanding -= 1
            if any(error.reason == "worker_busy" for error in result.errors):  # refused, not run
                counts["refused"] += 1
                await asyncio.sleep(0.001)  # back off (a load-aware router would have sent it elsewhere)
            else:
                counts["batches"] += 1
                counts["rows"] += len(result.item_ids) + len(result.errors)
                counts["queue_us"].append(result.queue_us)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the closed loop and summarise."""
    executor = Executor("cpu", 1)
    profile = tuple(float(v) for v in args.profile.split(","))
    model = load_model(args.model, (profile[0], profile[1]), executor)
    metrics = WorkerMetrics()
    models = {(model.spec.name, model.spec.version): model}
    runner = BatchRunner(
        executor,
        models,
        metrics,
        capacity=args.capacity,
        clock=MonotonicClock(),
        forward_on_loop=args.forward_on_loop,
    )
    loop = asyncio.get_running_loop()
    assert isinstance(loop, CountingLoop)
    runner.start()
    try:
        start_calls = loop.threadsafe_calls
        cpu, wall = time.process_time(), time.monotonic()
        until = wall + args.duration
        per_stream = await asyncio.gather(
            *(stream_loop(runner, model, args, until, seed) for seed in range(args.streams))
        )
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        calls = loop.threadsafe_calls - start_calls
    finally:
        await runner.stop()
    batches = sum(s["batches"] for s in per_stream)
    rows = sum(s["rows"] for s in per_stream)
    forwards = _sample(metrics, "sluice_worker_batch_size_count")
    waits = np.array([w for s in per_stream for w in s["queue_us"]] or [0]) / 1000
    return {
        "model": args.model,
        "profile_ms": args.profile if args.model == "synthetic" else None,
        "streams": args.streams,
        "in_flight": args.in_flight,
        "rows_per_batch": args.rows,
        "capacity": args.capacity,
        "forward_on_loop": args.forward_on_loop,
        "batches_per_s": round(batches / wall, 1),
        "rows_per_s": round(rows / wall, 1),
        "refused_batches": sum(s["refused"] for s in per_stream),
        "rows_per_forward": round(_sample(metrics, "sluice_worker_batch_size_sum") / max(forwards, 1), 2),
        "queue_ms_p50": round(float(np.percentile(waits, 50)), 2),
        "queue_ms_p99": round(float(np.percentile(waits, 99)), 2),
        "loop_wakeups_per_batch": round(calls / max(batches, 1), 3),
        "cpu_ms_per_batch": round(cpu * 1000 / max(batches, 1), 3),
    }


def _sample(metrics: WorkerMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model": metrics_model(metrics)})
    return float(value or 0.0)


def metrics_model(metrics: WorkerMetrics) -> str:
    """The one model label the benchmark's metrics carry."""
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "sluice_worker_batch_size_count":
                return str(sample.labels["model"])
    return ""


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, print one JSON line."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--model", choices=("synthetic", "mlp"), default="synthetic")
    parser.add_argument("--profile", default="5,0.5", help="synthetic a,c in ms (t(b) = a + c·b)")
    parser.add_argument("--streams", type=int, default=1, help="simulated routers")
    parser.add_argument("--in-flight", type=int, default=2, help="batches each keeps outstanding")
    parser.add_argument("--rows", type=int, default=8, help="one-row items per batch")
    parser.add_argument("--capacity", type=int, default=4, help="batches the worker holds at once")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds")
    parser.add_argument(
        "--forward-on-loop", action="store_true", help="run forwards on the event loop, no device thread"
    )
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        result = runner.run(measure(args))
    line = json.dumps(result)
    print(line)
    if args.json is not None:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
