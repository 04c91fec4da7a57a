"""A TorchScript model's forward, CPU per call and per row, by batch size (one torch thread, as a CPU worker
runs it): how much a fuller batch saves in the forward itself, beside the per-batch hop it also saves.

The peers' MLP (256 → 1024 → 1024 → 10, 5.3 MB of FP32 weights) is the model of docs/performance.md's
sittings; any TorchScript file whose forward takes one FP32 [rows, features] tensor works. The module is
timed as the worker runs it, frozen and optimized for inference (worker/backends/torchscript.py
`for_inference`; `--as-loaded` times it as `torch.jit.load` gives it, as this bench did before the worker
froze its modules: the peers' MLP costs up to twice as much that way). Each size is warmed up, then timed
over `--calls` forwards with `time.process_time`, inside `torch.inference_mode`. `--gap-ms` sleeps between
the timed forwards (the sleep is not CPU time): a worker's forwards are spaced by its own and the router's
work, and a forward after a pause finds its weights out of the caches. With `--spin` the gap is spent
busy instead, touching no memory (the gap's CPU is not counted either): the core never idles and nothing
of this process evicts the weights, so what a gap still costs is other work on the machine reclaiming
the shared cache (docs/performance.md, "The afternoon of 2026-12-03").

    python -m sluice_inference.bench.forward_rows ~/.cache/sluice-peers/models/mlp/1/model.pt
    python -m sluice_inference.bench.forward_rows MODEL.pt --features 256 --rows 1,2,4,8,16,32 [--gap-ms 1]
        [--spin]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from sluice_inference.worker.backends.torchscript import for_inference


def cpu_per_forward(
    model: torch.jit.ScriptModule,
    rows: int,
    features: int,
    calls: int,
    gap_s: float = 0.0,
    *,
    spin: bool = False,
) -> float:
    """CPU seconds of one forward of `rows` rows, averaged over `calls` after a warm-up, `gap_s` between
    them asleep (or busy, with `spin`)."""
    x = torch.randn(rows, features)
    with torch.inference_mode():
        for _ in range(max(10, calls // 10)):
            model(x)
        spent = 0.0
        for _ in range(calls):
            if gap_s:
                _gap(gap_s, spin)
            start = time.process_time()
            model(x)
            spent += time.process_time() - start
        return spent / calls


def _gap(seconds: float, spin: bool) -> None:
    """Wait `seconds`, asleep, or busy on the clock alone (touching no memory) with `spin`."""
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a TorchScript file")
    parser.add_argument("--features", type=int, default=256, help="the input's one non-batch dim")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,16,32", help="batch sizes, comma-separated")
    parser.add_argument("--calls", type=int, default=300, help="timed forwards per size")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="sleep between timed forwards (ms)")
    parser.add_argument("--spin", action="store_true", help="spend the gap busy, not asleep")
    parser.add_argument(
        "--as-loaded", action="store_true", help="time the module as loaded, not frozen for inference"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = torch.jit.load(str(args.model)).eval()  # type: ignore[no-untyped-call]  # torch.jit has no stubs
    model = loaded if args.as_loaded else for_inference(loaded, args.model)
    form = "as loaded" if args.as_loaded else "frozen for inference, as the worker runs it"
    print(f"# the module {form}")
    print("rows  µs per forward  µs per row")
    for rows in (int(r) for r in args.rows.split(",")):
        seconds = cpu_per_forward(model, rows, args.features, args.calls, args.gap_ms / 1000, spin=args.spin)
        print(f"{rows:4d}  {seconds * 1e6:14.0f}  {seconds * 1e6 / rows:10.0f}")


if __name__ == "__main__":
    main()
