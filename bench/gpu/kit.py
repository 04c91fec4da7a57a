"""The GPU kit's run (docs/gpu.md): one cluster, five stages, one JSON and one PNG under the output folder.

    python -m sluice_inference.bench.gpu.kit --device cuda:0 --out "$OUT"          # on the GPU machine
    python -m sluice_inference.bench.gpu.kit --device cpu --quick --out /tmp/kit   # the CPU rehearsal

Rules:
1. Stages run in the issue's order (correctness; the device curve; Sluice end to end with batching on
   and off; an out-of-memory batch; a killed worker; router CPU per request), the ones that loop inside
   time boxes (`budgets_s`), the others bounded by their requests' timeouts, and the JSON is rewritten
   after every stage: a run cut short still returns what it measured.
2. A stage that fails records its error in the JSON and the next stage still runs; the exit status says
   whether every stage ran and passed its checks.
3. Everything started is stopped before exit (common/local_cluster.py: workers, routers, etcd; children
   die with this process if it is killed).
The model is the transformer demo (worker/demo_transformer.py): BERT-base-shaped on a GPU, the tiny shape
with --quick. Nothing here is simulated: the CPU rehearsal runs the same code on smaller shapes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sluice_inference.bench.gpu import checks, plot
from sluice_inference.bench.gpu.in_process import InProcessModel, bound_at, device_curve
from sluice_inference.bench.gpu.through_sluice import Fleet, Load, NvmlSampler, measured_step, pin, tree_pids
from sluice_inference.common.buckets import bucket_for
from sluice_inference.common.child_processes import Child
from sluice_inference.common.local_cluster import ClusterEnv, free_port, start_cluster, stop_cluster
from sluice_inference.worker.demo_transformer import (
    BERT_BASE,
    TINY,
    EncoderShape,
    encoder_config,
    scripted_bytes,
    write_encoder,
)

JSON_NAME, PNG_NAME = "gpu_kit.json", "gpu_kit.png"


@dataclass(frozen=True)
class Plan:
    """Sizes, rates and time boxes of one run; `for_device` makes the GPU plan or the --quick one."""

    device: str
    quick: bool
    shape: EncoderShape
    routers: int
    slo_ms: float
    lengths: list[int]
    step_s: float
    rate_fractions: list[float]
    rate_cap: float
    curve_warmup: int
    curve_reps: int
    budgets_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def for_device(cls, device: str, quick: bool, routers: int) -> Plan:
        """GPU: BERT-base, 8 s steps up to 1.25x the in-process bound; --quick: tiny shapes, 2 s steps."""
        if quick:
            return cls(
                device, True, TINY, routers, slo_ms=1000.0, lengths=[9, 12, 16], step_s=2.0,
                rate_fractions=[0.3, 1.0], rate_cap=60.0, curve_warmup=1, curve_reps=3,
                budgets_s={"device_curve": 10, "end_to_end": 25, "worker_kill": 30},
            )  # fmt: skip
        return cls(
            device, False, BERT_BASE, routers, slo_ms=100.0, lengths=list(range(33, 65, 4)), step_s=8.0,
            rate_fractions=[0.1, 0.25, 0.5, 0.75, 0.9, 1.1, 1.3], rate_cap=8000.0,
            curve_warmup=5, curve_reps=20,
            budgets_s={"device_curve": 50, "end_to_end": 150, "worker_kill": 80},
        )  # fmt: skip

    @property
    def cuda(self) -> bool:
        """Whether the worker and the in-process model run on a CUDA device."""
        return self.device.startswith("cuda")

    @property
    def bucket(self) -> int:
        """The bucket every end-to-end request pads to (all `lengths` share it)."""
        return bucket_for(max(self.lengths), self.shape.buckets)


class Report:
    """The run's JSON, rewritten whole (atomically) after every stage."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"kit": header, "stages": {}, "errors": {}}
        self.save()

    def stage(self, name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run one stage, record its figures (or its error) and its seconds, save; its figures or None."""
        started = time.monotonic()
        print(f"== stage {name}", flush=True)
        try:
            figures: dict[str, Any] | None = run()
        except Exception as exc:  # rule 2: recorded in the JSON, the next stage still runs
            traceback.print_exc()
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"
            figures = None
        if figures is not None:
            figures["seconds"] = round(time.monotonic() - started, 2)
            self.data["stages"][name] = figures
        self.save()
        return figures

    def save(self) -> None:
        """Write the JSON (to a temporary name, then renamed: a reader never sees half of it)."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


def write_repository(root: Path, plan: Plan) -> list[str]:
    """The kit's models: `bert`, its half variants, `bert_b1` (batching off) and on CUDA `bert_oom`."""
    shape, fp32 = plan.shape, scripted_bytes(plan.shape)
    write_encoder(root, encoder_config("bert", shape), fp32)
    b1 = encoder_config("bert_b1", shape, max_batch_size=1, warmup_batch_sizes=[1])
    write_encoder(root, b1, fp32)
    names = ["bert", "bert_b1"]
    for dtype in ("fp16", "bf16"):
        # On a CPU worker `device: gpu` would be refused: the rehearsal serves them on the CPU.
        config = encoder_config(f"bert_{dtype}", shape, dtype, device="gpu" if plan.cuda else "auto")
        write_encoder(root, config, scripted_bytes(shape, dtype))
        names.append(f"bert_{dtype}")
    if plan.cuda:
        batching = {"max_wait_ms": 50.0, "buckets": {"tokens": [shape.max_positions]}, "mask_input": "mask"}
        oom = encoder_config("bert_oom", shape, batching=batching, warmup_batch_sizes=[1])
        write_encoder(root, oom, fp32)
        names.append("bert_oom")
    return names


class Kit:
    """One run: the cluster, the in-process model and the report."""

    def __init__(self, plan: Plan, out: Path, work: Path) -> None:
        self.plan, self.out, self.work = plan, out, work
        self.routers = plan.routers  # 1 if several router processes cannot start here (`start`)
        self.repository = work / "models"
        self.logs = out / "logs"  # the processes' logs come back with the figures
        self.children: list[Child] = []
        self.env: ClusterEnv | None = None
        self.fleet: Fleet | None = None
        self.etcd_endpoint = ""
        self.nvml = NvmlSampler.create(plan.device)
        self.reference: InProcessModel | None = None
        self.client: checks.Client | None = None
        self.report = Report(out / JSON_NAME, self._header())

    def _header(self) -> dict[str, Any]:
        plan = self.plan
        header = {
            "command": " ".join(sys.argv), "started_at": datetime.datetime.now(datetime.UTC).isoformat(),
            "device": plan.device, "quick": plan.quick, "torch": torch.__version__, "cpus": os.cpu_count(),
            "plan": {**asdict(plan), "shape": asdict(plan.shape)},
            "simulated": False,
        }  # fmt: skip
        if plan.cuda:
            header["device_name"] = torch.cuda.get_device_name(torch.device(plan.device))
            header["cuda"] = torch.version.cuda
        return header

    def start(self) -> None:
        """Write the models, start etcd, the routers and one worker on the device; wait until it serves.
        If several router processes cannot start (they share a port through SO_REUSEPORT, which a
        sandboxed kernel may lack), start again with one and say so in the JSON."""
        self.report.data["kit"]["models"] = write_repository(self.repository, self.plan)
        os.environ["SLUICE_WORKER__DEVICE"] = self.plan.device  # the workers' device (config env prefix)
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            self._start_cluster()
        except (RuntimeError, TimeoutError) as exc:
            if self.routers == 1:
                raise
            stop_cluster(self.children)
            self.children.clear()
            self.report.data["kit"]["router_fallback"] = f"{self.routers} router processes failed ({exc}); 1"
            self.routers = 1
            self._start_cluster()
        self._pin()
        assert self.fleet is not None
        self.client = checks.Client(self.fleet.target, self.work)
        self.reference = InProcessModel(self.repository, "bert", self.plan.device)

    def _start_cluster(self) -> None:
        args = argparse.Namespace(
            etcd_port=free_port(), port=free_port(), metrics_port=free_port(), config=None, workers=1,
            repository=self.repository, ready_timeout=240.0, router_processes=self.routers,
        )  # fmt: skip
        started = time.monotonic()
        self.env = start_cluster(args, self.work / "data", self.logs, self.children, threading.Event())
        self.report.data["kit"]["cluster_start_s"] = round(time.monotonic() - started, 2)
        self.etcd_endpoint = f"127.0.0.1:{args.etcd_port}"
        ports = (
            [args.metrics_port + i for i in range(self.routers)] if self.routers > 1 else [args.metrics_port]
        )
        self.fleet = Fleet(f"127.0.0.1:{args.port}", ports, self._child("router").process.pid)

    def _pin(self) -> None:
        """On a machine of 8+ cores: the load generator (this process) on 4 cores, the routers on 2 per
        router process, the worker and etcd on the rest; recorded in the JSON."""
        cores = os.cpu_count() or 1
        if cores < 8 or self.fleet is None:
            self.report.data["kit"]["pinning"] = f"none ({cores} cores)"
            return
        routers_end = min(cores - 2, 4 + 2 * self.routers)
        layout = {"loadgen": list(range(0, 4)), "routers": list(range(4, routers_end)),
                  "worker_and_etcd": list(range(routers_end, cores))}  # fmt: skip
        try:
            pin([os.getpid()], layout["loadgen"])
            pin(tree_pids(self.fleet.router_pid), layout["routers"])
            for child in self.children:
                if child.name != "router":
                    pin(tree_pids(child.process.pid), layout["worker_and_etcd"])
        except OSError as exc:  # a sandbox may refuse affinity: measure unpinned, and say so
            self.report.data["kit"]["pinning"] = f"refused ({exc}): none"
            return
        self.report.data["kit"]["pinning"] = layout

    def _child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def _left(self, name: str) -> Callable[[], float]:
        deadline = time.monotonic() + self.plan.budgets_s[name]
        return lambda: deadline - time.monotonic()

    def run(self) -> bool:
        """Every stage in order; whether all ran and passed."""
        report = self.report
        try:
            report.stage("cluster", self._cluster_stage)
            if "cluster" not in report.data["stages"]:
                return False
            report.stage("correctness", self.correctness)
            report.stage("device_curve", self.curve)
            report.stage("end_to_end", self.end_to_end)
            report.stage("oom", self.out_of_memory)
            report.stage("worker_kill", self.worker_kill)
            report.stage("router_cpu", self.router_cpu)
        finally:
            stop_cluster(self.children)
            report.data["kit"]["finished_at"] = datetime.datetime.now(datetime.UTC).isoformat()
            report.data["plot"] = self._plot()
            report.save()
        return self._passed()

    def _cluster_stage(self) -> dict[str, Any]:
        self.start()
        return {
            "routers": self.routers,
            "workers": 1,
            "start_s": self.report.data["kit"]["cluster_start_s"],
        }

    def _passed(self) -> bool:
        stages = self.report.data["stages"]
        wanted = {"cluster", "correctness", "device_curve", "end_to_end", "oom", "worker_kill", "router_cpu"}
        return (
            not self.report.data["errors"] and wanted <= set(stages)
            and stages["correctness"]["passed"] and stages["oom"]["passed"]
            and stages["worker_kill"]["nothing_lost"]
        )  # fmt: skip

    def correctness(self) -> dict[str, Any]:
        """Stage 1: served answers against the model in this process on the same device."""
        assert self.client is not None and self.reference is not None
        local = {"bert": self.reference}
        for name in ("bert_fp16", "bert_bf16"):
            local[name] = InProcessModel(self.repository, name, self.plan.device)
        lengths = [3, *self.plan.lengths, self.plan.shape.buckets[-1]]
        rows = checks.token_rows(self.plan.shape.vocab, lengths, seed=1)
        return checks.correctness(self.client, self.reference, local, rows)

    def curve(self) -> dict[str, Any]:
        """Stage 2: forward time and items/s by batch and bucket, in this process."""
        assert self.reference is not None
        left = self._left("device_curve")
        points = device_curve(self.reference, self.plan.curve_warmup, self.plan.curve_reps, left)
        best: dict[int, float] = {}
        for p in points:
            best[p.bucket] = max(best.get(p.bucket, 0.0), p.items_per_s)
        timing = "CUDA events" if self.plan.cuda else "process CPU time"
        return {
            "model": "bert", "timing": timing, "warmup": self.plan.curve_warmup, "reps": self.plan.curve_reps,
            "points": [asdict(p) for p in points], "best_items_per_s_by_bucket": best,
        }  # fmt: skip

    def end_to_end(self) -> dict[str, Any]:
        """Stage 3: open-loop steps at rising rates, batching on (`bert`) then off (`bert_b1`)."""
        assert self.fleet is not None
        points = self._curve_points()
        bound = bound_at(points, self.plan.bucket, self.plan.shape.max_batch_size)
        bound_b1 = bound_at(points, self.plan.bucket, 1)
        top = min(bound or self.plan.rate_cap, self.plan.rate_cap)
        rates = [round(f * top, 1) for f in self.plan.rate_fractions]
        left = self._left("end_to_end")
        steps = self._steps("bert", rates, left, share=0.7)
        steps += self._steps("bert_b1", rates, left, share=1.0)
        figures: dict[str, Any] = {
            "slo_ms": self.plan.slo_ms, "lengths": self.plan.lengths, "bucket": self.plan.bucket,
            "in_process_bound_items_per_s": bound, "in_process_batch1_items_per_s": bound_b1,
            "rates": rates, "steps": steps,
        }  # fmt: skip
        on = [s for s in steps if s["model"] == "bert"]
        off = [s for s in steps if s["model"] == "bert_b1"]
        if on:
            best = max(on, key=lambda s: s["goodput_rps"])
            at_batch = bound_at(points, self.plan.bucket, best["mean_batch"] or 1.0)
            figures["best"] = {
                "rate": best["rate"], "goodput_rps": best["goodput_rps"], "mean_batch": best["mean_batch"],
                "in_process_at_that_batch": at_batch,
                "ratio_to_in_process_at_that_batch": best["goodput_rps"] / at_batch if at_batch else None,
                "ratio_to_in_process_bound": best["goodput_rps"] / bound if bound else None,
            }  # fmt: skip
            if off:
                best_off = max(s["goodput_rps"] for s in off)
                figures["batching_gain"] = best["goodput_rps"] / best_off if best_off else None
        return figures

    def _curve_points(self) -> list[Any]:
        from sluice_inference.bench.gpu.in_process import CurvePoint

        curve = self.report.data["stages"].get("device_curve", {})
        return [CurvePoint(**p) for p in curve.get("points", [])]

    def _steps(
        self, model: str, rates: list[float], left: Callable[[], float], share: float
    ) -> list[dict[str, Any]]:
        """Steps at `rates` until goodput falls under half the offered rate (past saturation) or this
        model's `share` of the stage's time box is spent."""
        assert self.fleet is not None
        budget = self.plan.budgets_s["end_to_end"]
        steps = []
        for rate in rates:
            if left() < budget * (1 - share) + self.plan.step_s + 2:
                break
            load = Load(self.fleet.target, model, rate, self.plan.step_s, self.plan.slo_ms, self.plan.lengths)
            step = measured_step(self.fleet, load, self.nvml)
            print(f"   {model} {rate:g}/s: goodput {step['goodput_rps']:.1f}/s p99 {step['p99_ms']} ms "
                  f"mean batch {step['mean_batch']}", flush=True)  # fmt: skip
            steps.append(step)
            if step["goodput_rps"] < 0.5 * rate:
                break
        return steps

    def out_of_memory(self) -> dict[str, Any]:
        """Stage 4a: a batch too big for the device memory left (CUDA only) is split or refused, and the
        worker keeps serving."""
        assert self.client is not None
        if not self.plan.cuda:
            return {"skipped": "CPU: no device memory to exhaust (runs on CUDA only)", "passed": True}
        shape = self.plan.shape
        oom = checks.OomPlan(
            "bert_oom", requests=8, rows=shape.max_batch_size // 8, length=shape.max_positions,
            vocab=shape.vocab, headroom_bytes=256 << 20,
        )  # fmt: skip
        log = self._child("worker-1").log_path
        return checks.out_of_memory(
            self.client, oom, self.plan.device, lambda: log.read_text(errors="replace") if log else ""
        )

    def worker_kill(self) -> dict[str, Any]:
        """Stage 4b: a second worker (serving `bert`) joins; under load the first is SIGKILLed. After the
        out-of-memory check: the second worker's warm-up must not meet the memory that check holds."""
        assert self.fleet is not None and self.env is not None
        argv = [sys.executable, "-m", "sluice_inference.cli", "worker", "--repository", str(self.repository),
                "--etcd", self.etcd_endpoint, "--worker-id", "worker-2", "--models", "bert"]  # fmt: skip
        self.children.append(Child("worker-2", argv, self.logs, self.env.worker_env("worker-2")))
        joined = time.monotonic()
        left = self._left("worker_kill")
        while checks_accepting(self.fleet) < 2:
            if left() < self.plan.step_s * 2 or not self._child("worker-2").alive():
                raise RuntimeError("worker-2 did not start serving in time (see worker-2.log)")
            time.sleep(0.2)
        e2e = self.report.data["stages"].get("end_to_end", {})
        rate = 0.5 * e2e.get("best", {}).get("goodput_rps", 0.0) or min(self.plan.rate_cap, 20.0)
        duration = 2 * self.plan.step_s
        load = Load(
            self.fleet.target, "bert", round(rate, 1), duration, self.plan.slo_ms * 5, self.plan.lengths
        )
        victim = self._child("worker-1").process.pid
        result = checks.worker_kill(self.fleet, load, victim, duration / 3, self.nvml)
        result["second_worker_ready_s"] = round(time.monotonic() - joined, 2)
        return result

    def router_cpu(self) -> dict[str, Any]:
        """Stage 5: the routers' CPU per request at the best rate (from its end-to-end step)."""
        e2e = self.report.data["stages"]["end_to_end"]
        best_rate = e2e["best"]["rate"]
        step = next(s for s in e2e["steps"] if s["model"] == "bert" and s["rate"] == best_rate)
        per_ok = step["router_cpu_ms_per_ok"]
        return {
            "rate": best_rate, "routers": self.routers, "router_cpu_s": step["router_cpu_s"],
            "router_cpu_ms_per_request": per_ok,
            "requests_per_router_core_s": 1000.0 / per_ok if per_ok else None,
            "note": "CPU of every router process (user + system, /proc) over the step, per OK answer",
        }  # fmt: skip

    def _plot(self) -> dict[str, str]:
        path = self.out / PNG_NAME
        try:
            how = plot.draw(self.report.data["stages"], path)
        except (OSError, ValueError, KeyError) as exc:
            return {"skipped": f"{type(exc).__name__}: {exc}"}
        return {"path": PNG_NAME, "how": how}


def checks_accepting(fleet: Fleet) -> int:
    """Workers the first router process counts as accepting batches (its /metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.metrics_ports[0]}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith('sluice_router_workers{accepting="true"}'):
                return int(float(line.rsplit(" ", 1)[1]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the kit; exit 0 only when every stage ran and passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="cuda:0", help="the worker's device: cuda:N or cpu (default cuda:0)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes and short steps (the CPU rehearsal)"
    )
    parser.add_argument(
        "--routers", type=int, default=0, help="router processes (default: 4 on 16+ cores, else 1)"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_kit.json and gpu_kit.png")
    args = parser.parse_args(argv)
    # run.sh's time limit sends SIGTERM: exit through the `finally`s, so the cluster is stopped and the
    # JSON of the stages that finished is written with the plot.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    routers = args.routers or (4 if (os.cpu_count() or 1) >= 16 else 1)
    # The worker runs its forwards on one intra-op thread: the in-process reference does the same, so
    # FP32 answers can be compared bit for bit.
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sluice-gpu-kit-") as work:
        kit = Kit(Plan.for_device(args.device, args.quick, routers), args.out, Path(work))
        passed = kit.run()
    print(f"wrote {args.out / JSON_NAME}: {'all stages passed' if passed else 'NOT all stages passed'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
