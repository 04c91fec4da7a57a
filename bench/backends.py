"""ONNX Runtime vs TorchScript (and torch.export) on the demo MLP: forward time and samples/s per batch size.

    python -m sluice_inference.bench.backends [--batches 1,32] [--seconds 2] [--threads 1]

Each backend is loaded by the worker's own code (`sluice_inference.worker.backends.load_backend`) from a
temporary Triton repository holding the demo MLP's weights in three formats: TorchScript
(traced, `pytorch_libtorch`), ONNX (`onnxruntime_onnx`, the graph `sluice models init` writes) and
torch.export (the demo's `.pt2`). Then, per batch size, every backend runs the same random batch, round after
round in turn (so a background disturbance hits them all alike), for `--seconds` in all; the figure is the
median forward time over its rounds, and samples/s = batch / median. The executor's own work
(validation, stacking, copies) is the same for every backend and left out. Real measurements of real models on
this machine's CPU, under the worker's thread setting (1 intra-op thread by default).
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from sluice_inference.worker.backends import Backend, load_backend
from sluice_inference.worker.demo_models import build_mlp, export_mlp
from sluice_inference.worker.demo_onnx import mlp_onnx_bytes
from sluice_inference.worker.repository import scan_repository

MAX_BATCH = 64
_CONFIG = """
platform: "{platform}"
max_batch_size: {max_batch}
input [ {{ name: "{input}" data_type: TYPE_FP32 dims: [ 256 ] }} ]
output [ {{ name: "{output}" data_type: TYPE_FP32 dims: [ 10 ] }} ]
dynamic_batching {{ }}
"""


def write_formats(root: Path) -> None:
    """The demo MLP as `torchscript/1/model.pt`, `onnx/1/model.onnx` and `torch_export/1/model.pt2`."""
    mlp = build_mlp()
    (root / "torchscript" / "1").mkdir(parents=True)
    traced = torch.jit.trace(mlp, torch.zeros(2, 256))  # type: ignore[no-untyped-call]
    torch.jit.save(traced, str(root / "torchscript" / "1" / "model.pt"))
    (root / "torchscript" / "config.pbtxt").write_text(
        _CONFIG.format(platform="pytorch_libtorch", max_batch=MAX_BATCH, input="INPUT__0", output="OUTPUT__0")
    )
    (root / "onnx" / "1").mkdir(parents=True)
    (root / "onnx" / "1" / "model.onnx").write_bytes(mlp_onnx_bytes(mlp))
    (root / "onnx" / "config.pbtxt").write_text(
        _CONFIG.format(platform="onnxruntime_onnx", max_batch=MAX_BATCH, input="input", output="output")
    )
    (root / "torch_export" / "1").mkdir(parents=True)
    buffer = io.BytesIO()
    torch.export.save(export_mlp(MAX_BATCH), buffer)
    (root / "torch_export" / "1" / "model.pt2").write_bytes(buffer.getvalue())
    (root / "torch_export" / "config.yaml").write_text(
        "name: torch_export\nbackend: torch_export\nmax_batch_size: 64\n"
        "inputs: [{name: input, datatype: FP32, dims: [256]}]\n"
        "outputs: [{name: output, datatype: FP32, dims: [10]}]\n"
    )


def _forward_s(backend: Backend, inputs: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        backend.forward(inputs)
    return time.perf_counter() - start


def measure(backends: dict[str, Backend], batch: int, seconds: float) -> dict[str, float]:
    """Median forward seconds per backend at `batch` rows, rounds interleaved over `seconds`."""
    x = torch.from_numpy(np.random.default_rng(batch).standard_normal((batch, 256)).astype(np.float32))
    names = {"torchscript": "INPUT__0"}
    for name, backend in backends.items():  # warm-up, as a worker does before it serves
        for _ in range(3):
            _forward_s(backend, {names.get(name, "input"): x})
    samples: dict[str, list[float]] = {name: [] for name in backends}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or min(len(s) for s in samples.values()) < 5:
        for name, backend in backends.items():
            samples[name].append(_forward_s(backend, {names.get(name, "input"): x}))
    return {name: statistics.median(times) for name, times in samples.items()}


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes (default 1,32)")
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="measuring time per batch size (default 2)"
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads, as worker.torch_threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)  # ONNX Runtime sessions take the same budget at load
    batches = [int(b) for b in args.batches.split(",") if b]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_formats(root)
        backends = {spec.name: load_backend(spec, "cpu") for spec in scan_repository(root)}
        print(f"demo MLP 256-1024-1024-10, CPU, {args.threads} thread(s), median over {args.seconds:g} s")
        print(f"{'backend':<14} {'batch':>5} {'forward ms':>11} {'samples/s':>10} {'vs torchscript':>15}")
        for batch in batches:
            medians = measure(backends, batch, args.seconds)
            for name in ("torchscript", "onnx", "torch_export"):
                ratio = medians["torchscript"] / medians[name]
                ms, rate = medians[name] * 1e3, batch / medians[name]
                print(f"{name:<14} {batch:>5} {ms:>11.3f} {rate:>10.0f} {ratio:>14.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
