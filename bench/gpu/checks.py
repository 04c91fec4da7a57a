"""The kit's checks through a live cluster: answers equal the model in-process (stage 1), a CUDA
out-of-memory batch is handled and the worker keeps serving, and a worker SIGKILLed under load loses
nothing (stage 4).

Requests go through the official Triton client (`tritonclient[grpc]`, in a child process:
bench/gpu/triton_requests.py) when it is installed, as a Triton user's would; otherwise through the
KServe v2 stub Sluice generates (the JSON names which). Either way
one request carries one [rows, L] INT64 `tokens` tensor and asks for `pooled`.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from sluice_inference.bench.gpu.in_process import InProcessModel
from sluice_inference.bench.gpu.through_sluice import Fleet, Load, NvmlSampler, measured_step
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc

Array = npt.NDArray[Any]
TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 3e-2}
"""Largest |served - in-process FP32| allowed per element, a request alone. FP32 is expected bit for bit
(same device, weights, padding and shapes; `bit_exact` says whether it was, and the CPU rehearsal's test
requires it), but on CUDA TorchScript's fuser may fuse elementwise ops differently in two processes that
first saw different shapes, which moves the last bits; half precision: what its mantissa keeps of
outputs in [-1, 1]."""
BATCHED_TOLERANCE = 1e-4
"""FP32 rows answered in one batch with others against the same rows alone: batch size changes the
kernels' summation order, nothing else."""


Outcome = Array | str
"""A request's `pooled` output, or the text of the error it got."""


class Client:
    """Inference requests to a router: through tritonclient in a child process when it is installed,
    else through Sluice's KServe v2 stub here."""

    def __init__(self, target: str, scratch: Path) -> None:
        self.target = target
        self._scratch = scratch
        self._triton = importlib.util.find_spec("tritonclient") is not None
        self.kind = "tritonclient.grpc" if self._triton else "sluice KServe v2 stub (no tritonclient here)"
        self._stub = kserve_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(target))

    def infer_many(self, model: str, requests: list[Array], concurrent: bool = False) -> list[Outcome]:
        """One outcome per request ([rows, L] INT64 tokens each), sent one by one or all at once."""
        if self._triton:
            return self._through_triton(model, requests, concurrent)
        if not concurrent:
            return [self._infer(model, tokens) for tokens in requests]
        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(lambda tokens: self._infer(model, tokens), requests))

    def _through_triton(self, model: str, requests: list[Array], concurrent: bool) -> list[Outcome]:
        given, got = self._scratch / "requests.npz", self._scratch / "outcomes.npz"
        np.savez(given, **{f"r{i}": tokens for i, tokens in enumerate(requests)})  # type: ignore[arg-type]
        argv = [sys.executable, "-m", "sluice_inference.bench.gpu.triton_requests", "--target", self.target,
                "--model", model, "--rows", str(given), "--out", str(got)]  # fmt: skip
        subprocess.run([*argv, *(["--concurrent"] if concurrent else [])], check=True, timeout=120)
        with np.load(got) as data:
            return [
                data[f"r{i}"] if f"r{i}" in data.files else str(data[f"e{i}"]) for i in range(len(requests))
            ]

    def _infer(self, model: str, tokens: Array) -> Outcome:
        request = kserve.ModelInferRequest(model_name=model)
        request.inputs.add(name="tokens", datatype="INT64", shape=list(tokens.shape))
        request.raw_input_contents.append(np.ascontiguousarray(tokens, "<i8").tobytes())
        request.outputs.add(name="pooled")
        try:
            reply = self._stub.ModelInfer(request, timeout=60)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        shape = tuple(reply.outputs[0].shape)
        return np.frombuffer(reply.raw_output_contents[0], "<f4").reshape(shape)


def answers(outcomes: list[Outcome]) -> list[Array]:
    """The outputs, or RuntimeError naming the first request that got an error."""
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, str):
            raise RuntimeError(f"request {i} failed: {outcome}")
    return [o for o in outcomes if not isinstance(o, str)]


def token_rows(vocab: int, lengths: list[int], seed: int) -> list[Array]:
    """One [1, L] row of token ids per length."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=(1, n), dtype=np.int64) for n in lengths]


def max_diff(a: Array, b: Array) -> float:
    """Largest absolute elementwise difference."""
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def correctness(
    client: Client, reference: InProcessModel, same_dtype: dict[str, InProcessModel], rows: list[Array]
) -> dict[str, Any]:
    """Each model in `same_dtype` (name → its own in-process copy), one request at a time, against the
    in-process FP32 `reference`; then the FP32 model with all rows sent at once (batched by the router)."""
    expected = [reference.forward([row]) for row in rows]
    models: dict[str, Any] = {}
    for name, local in same_dtype.items():
        dtype = name.rpartition("_")[2] if "_" in name else "fp32"
        served = answers(client.infer_many(name, rows))
        vs_fp32 = max(max_diff(s, e) for s, e in zip(served, expected, strict=True))
        vs_own = max(max_diff(s, local.forward([row])) for s, row in zip(served, rows, strict=True))
        models[name] = {
            "dtype": dtype, "requests": len(rows), "max_abs_diff_vs_fp32": vs_fp32,
            "max_abs_diff_vs_same_dtype": vs_own, "bit_exact": vs_fp32 == 0.0, "tolerance": TOLERANCE[dtype],
            "passed": vs_fp32 <= TOLERANCE[dtype],
        }  # fmt: skip
    together = answers(client.infer_many(reference.config.name, rows, concurrent=True))
    batched = max(max_diff(s, e) for s, e in zip(together, expected, strict=True))
    return {
        "client": client.kind,
        "lengths": [int(row.shape[1]) for row in rows],
        "alone": models,
        "batched": {"requests": len(rows), "max_abs_diff": batched, "tolerance": BATCHED_TOLERANCE,
                    "passed": batched <= BATCHED_TOLERANCE},
        "passed": all(m["passed"] for m in models.values()) and batched <= BATCHED_TOLERANCE,
    }  # fmt: skip


@dataclass(frozen=True)
class OomPlan:
    """`requests` concurrent requests of `rows` rows of `length` tokens each, to `model`, while all but
    `headroom_bytes` of the device's free memory is held by the kit."""

    model: str
    requests: int
    rows: int
    length: int
    vocab: int
    headroom_bytes: int


def out_of_memory(
    client: Client, plan: OomPlan, device: str, worker_log: Callable[[], str]
) -> dict[str, Any]:
    """Fill the device, send a batch too big for what is left, free it, and check the worker still
    serves: every request must get an answer (OK, possibly after the worker split the batch, or an
    explicit error), and a request afterwards must be OK."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    hog = torch.empty(max(0, free - plan.headroom_bytes), dtype=torch.uint8, device=device)
    outcomes: dict[str, int] = {}
    try:
        rng = np.random.default_rng(5)
        payloads = [
            rng.integers(1, plan.vocab, size=(plan.rows, plan.length), dtype=np.int64)
            for _ in range(plan.requests)
        ]
        for outcome in client.infer_many(plan.model, payloads, concurrent=True):
            key = "OK" if not isinstance(outcome, str) else f"error: {outcome[:160]}"
            outcomes[key] = outcomes.get(key, 0) + 1
    finally:
        held = hog.numel()
        del hog
        torch.cuda.empty_cache()
    after = send_one(client, plan)
    log = worker_log()
    return {
        "model": plan.model, "requests": plan.requests, "rows_each": plan.rows, "length": plan.length,
        "device_free_bytes": free, "device_total_bytes": total, "held_bytes": held,
        "outcomes": outcomes, "answered": sum(outcomes.values()) == plan.requests,
        "oom_in_worker_log": "out of memory" in log.lower(),
        "worker_serves_after": after,
        "passed": sum(outcomes.values()) == plan.requests and after == "OK",
    }  # fmt: skip


def send_one(client: Client, plan: OomPlan) -> str:
    """One small request to the model after the out-of-memory batch: "OK" or the error."""
    [outcome] = client.infer_many(plan.model, [np.ones((1, 8), dtype=np.int64)])
    return outcome if isinstance(outcome, str) else "OK"


def worker_kill(
    fleet: Fleet, load: Load, victim_pid: int, kill_after_s: float, nvml: NvmlSampler | None
) -> dict[str, Any]:
    """Open-loop `load` with two workers up; SIGKILL `victim_pid` `kill_after_s` into it. Nothing lost:
    every request got an answer, and every answer is OK or an explicit status."""
    timer = threading.Timer(kill_after_s, os.kill, (victim_pid, signal.SIGKILL))
    timer.start()
    try:
        step = measured_step(fleet, load, nvml)
    finally:
        timer.cancel()
    lost = step["rejected_by_status"].get("CLIENT_ERROR/abandoned", 0)
    answered = step["ok"] + sum(step["rejected_by_status"].values()) - lost
    return {
        **step, "killed_pid": victim_pid, "killed_after_s": kill_after_s, "answered": answered, "lost": lost,
        "nothing_lost": lost == 0 and answered == step["offered"],
    }  # fmt: skip
