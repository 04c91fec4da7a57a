"""A TorchScript model's forward, CPU per call and per row, by batch size (one torch thread, as a CPU worker
runs it): how much a fuller batch saves in the forward itself, beside the per-batch hop it also saves.

The peers' MLP (256 → 1024 → 1024 → 10, 5.3 MB of FP32 weights) is the model of docs/performance.md's
sittings; any TorchScript file whose forward takes one FP32 [rows, features] tensor works. Each size is
warmed up, then timed over `--calls` forwards with `time.process_time`, inside `torch.inference_mode`.

    python -m sluice_inference.bench.forward_rows ~/.cache/sluice-peers/models/mlp/1/model.pt
    python -m sluice_inference.bench.forward_rows MODEL.pt --features 256 --rows 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def cpu_per_forward(model: torch.jit.ScriptModule, rows: int, features: int, calls: int) -> float:
    """CPU seconds of one forward of `rows` rows, averaged over `calls` after a warm-up."""
    x = torch.randn(rows, features)
    with torch.inference_mode():
        for _ in range(max(10, calls // 10)):
            model(x)
        start = time.process_time()
        for _ in range(calls):
            model(x)
        return (time.process_time() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a TorchScript file")
    parser.add_argument("--features", type=int, default=256, help="the input's one non-batch dim")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,16,32", help="batch sizes, comma-separated")
    parser.add_argument("--calls", type=int, default=300, help="timed forwards per size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = torch.jit.load(str(args.model)).eval()  # type: ignore[no-untyped-call]  # torch.jit has no stubs
    print("rows  µs per forward  µs per row")
    for rows in (int(r) for r in args.rows.split(",")):
        seconds = cpu_per_forward(model, rows, args.features, args.calls)
        print(f"{rows:4d}  {seconds * 1e6:14.0f}  {seconds * 1e6 / rows:10.0f}")


if __name__ == "__main__":
    main()
