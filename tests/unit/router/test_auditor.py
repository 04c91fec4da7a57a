"""The auditor (router/auditor.py) over the real cache gate and the demo MLP run on CPU, as a worker runs
the rows it is sent.

The attack it must withstand: a tenant caches a large-valued input while it rides in a batch, then hits it
until an audit re-runs it alone. On CPU the two differ by far more than the old fixed tolerance (1e-5);
the model's measured batch-vs-single deviation must cover that, so nothing is purged or disabled. A truly
wrong entry (here: a model whose outputs changed) is removed and charged to the tenant whose hit it was,
and nobody else loses a hit."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.records import ModelRecord, TensorSpec
from sluice_inference.common.serving_settings import CacheSettings
from sluice_inference.router.auditor import CacheAuditor, calibration_request
from sluice_inference.router.cache_gate import CacheGate
from sluice_inference.router.calls import InferCall, InferResult, InputTensor, ServedBy, Tensor
from sluice_inference.router.codec import DecodedRequest, decode_call
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.result_cache import CacheUse
from sluice_inference.router.policy.tenants import Tenant
from sluice_inference.router.stored_results import encode_result
from sluice_inference.router.stores.cache_store import ResultCacheStore
from sluice_inference.worker.demo_models import build_mlp
from tests.support.dataplane import Reply

OLD_TOLERANCE = 1e-5
DEMO = ModelRecord(
    name="mlp",
    version="1",
    digest="sha256:demo-mlp",
    platform="torch_export",
    max_batch_size=32,
    max_wait_s=0.0,
    inputs=(TensorSpec(name="input", datatype="FP32", dims=(256,)),),
    outputs=(TensorSpec(name="output", datatype="FP32", dims=(10,)),),
    deterministic=True,
    cache=True,
)


class MlpExecutor:
    """The driver seam: the demo MLP (fixed seed) on exactly the rows of each request, plus `shift` (a
    model that changed since the entry was stored). Records the rows of every run."""

    def __init__(self) -> None:
        self.model = build_mlp()
        self.shift = 0.0
        self.runs: list[int] = []

    def outputs(self, rows: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            y = self.model(torch.from_numpy(np.array(rows, copy=True))).numpy()
        shifted: np.ndarray = (y + self.shift).astype("<f4")
        return shifted

    async def infer(
        self, decoded: DecodedRequest, deadline: float, tenant: Tenant, priority: int, *, arrival: float
    ) -> Reply:
        x = decoded.inputs[0]
        self.runs.append(decoded.rows)
        y = self.outputs(np.frombuffer(x.data, "<f4").reshape(tuple(x.shape)))
        tensor = Tensor("output", "FP32", y.shape, y.tobytes())
        return Reply([tensor], ServedBy("w1", decoded.rows, 0.0))


class Audited:
    """An auditor, its gate and store (fake clock), and the metrics they count in."""

    def __init__(self, **settings: float | int) -> None:
        self.clock = FakeClock(100.0)
        self.metrics = RouterMetrics()
        self.metrics.tenants = frozenset({"gold", "silver"})
        self.executor = MlpExecutor()
        cache = CacheSettings.model_validate({"audit_fraction": 1.0, **settings})
        store = ResultCacheStore(capacity_bytes=1 << 20, ttl_s=600.0, clock=self.clock)
        self.gate = CacheGate(store, cache, self.metrics)
        self.auditor = CacheAuditor(
            self.executor, self.gate, settings=cache, metrics=self.metrics, clock=self.clock
        )

    async def cached(
        self, tenant: str, decoded: DecodedRequest, outputs: np.ndarray
    ) -> tuple[str, InferResult]:
        """Store `outputs` as the tenant's entry for `decoded`, as a miss would; (key, the hit it serves)."""
        key = self.gate.lookup(tenant, DEMO, decoded, {}).key
        tensor = Tensor("output", "FP32", tuple(outputs.shape), outputs.tobytes())
        result = InferResult("mlp", "1", "", (tensor,), None)
        await self.gate.store.put(key, encode_result(result), model="mlp", model_version="1")
        return key, result

    async def hit(self, tenant: str, key: str, decoded: DecodedRequest, cached: InferResult) -> None:
        self.auditor.on_hit(tenant, key, DEMO, decoded, cached)
        await self.auditor.drain()

    def audits(self, outcome: str) -> float:
        labels = {"model": "mlp", "outcome": outcome}
        return self.metrics.registry.get_sample_value("sluice_cache_audits_total", labels) or 0.0

    def mismatches(self, tenant: str) -> float:
        labels = {"model": "mlp", "tenant": tenant}
        return self.metrics.registry.get_sample_value("sluice_cache_audit_mismatches_total", labels) or 0.0


def request_for(row: np.ndarray) -> DecodedRequest:
    data = row.astype("<f4").reshape(1, -1).tobytes()
    tensor = InputTensor("input", "FP32", (1, 256), data=data)
    call = InferCall(
        model_name="mlp", model_version="", id="", inputs=(tensor,), outputs=(), parameters={},
        api_key=None, idempotency_key=None, time_remaining_s=None, body_bytes=len(data),
    )  # fmt: skip
    return decode_call(call, DEMO)


def batched_entry(executor: MlpExecutor, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A large-valued row (scale 1e3), its output computed inside a batch of 32, and alone."""
    batch = np.random.default_rng(seed).standard_normal((32, 256)).astype("<f4") * 1e3
    return batch[:1], executor.outputs(batch)[:1], executor.outputs(batch[:1])


def beyond_old_tolerance(executor: MlpExecutor) -> tuple[np.ndarray, np.ndarray]:
    """A row whose batched output differs from its single-row output by more than 1e-5 (the attack)."""
    for seed in range(50):
        row, in_batch, alone = batched_entry(executor, seed)
        if float(np.max(np.abs(in_batch - alone))) > OLD_TOLERANCE:
            return row, in_batch
    pytest.skip("this CPU's kernels give the same bits batched and alone: nothing to tell apart")


async def test_a_batched_entry_within_the_models_measured_deviation_is_not_a_mismatch() -> None:
    # Margin 1: the dtype's epsilon alone does not cover the gap, so the verdict rests on the measurement.
    audited = Audited(audit_margin=1.0)
    row, in_batch = beyond_old_tolerance(audited.executor)
    decoded = request_for(row)
    key, cached = await audited.cached("gold", decoded, in_batch)
    await audited.hit("gold", key, decoded, cached)
    assert audited.audits("match") + audited.audits("match_calibrated") == 1
    assert audited.audits("mismatch") == 0 and audited.mismatches("gold") == 0
    assert (audited.auditor.deviations.measured("mlp", "1") or 0.0) > 0  # learned from a calibration
    assert audited.executor.runs == [1, 32]  # alone, then repeated into a batch
    assert await audited.gate.store.get(key) is not None  # kept, and still served to everyone
    assert audited.gate.lookup("gold", DEMO, decoded, {}).use is CacheUse.LOOKUP


async def test_with_the_default_margin_the_attack_disables_nothing() -> None:
    audited = Audited()
    row, in_batch = beyond_old_tolerance(audited.executor)
    decoded = request_for(row)
    key, cached = await audited.cached("gold", decoded, in_batch)
    for _ in range(3):
        await audited.hit("gold", key, decoded, cached)
        audited.clock.advance(10.0)  # the audit budget refills
    assert audited.audits("mismatch") == 0
    assert await audited.gate.store.get(key) is not None
    assert audited.gate.lookup("silver", DEMO, decoded, {}).use is CacheUse.LOOKUP


async def test_a_wrong_entry_is_quarantined_and_charged_to_the_tenant_whose_hit_it_was() -> None:
    audited = Audited(audit_strikes=2)
    rows = [batched_entry(audited.executor, seed) for seed in (1, 2)]
    golds = [await audited.cached("gold", request_for(row), alone) for row, _, alone in rows]
    silver_row, _, silver_alone = rows[0]
    silver_key, _ = await audited.cached("silver", request_for(silver_row), silver_alone)
    audited.executor.shift = 0.5  # the model now answers differently: the stored entries are wrong
    (row, _, _), (key, cached) = rows[0], golds[0]
    await audited.hit("gold", key, request_for(row), cached)
    assert audited.audits("mismatch") == 1 and audited.mismatches("gold") == 1
    assert audited.mismatches("silver") == 0
    assert await audited.gate.store.get(key) is None  # that entry only
    assert await audited.gate.store.get(golds[1][0]) is not None
    assert await audited.gate.store.get(silver_key) is not None  # other tenants keep their hits
    assert audited.gate.lookup("gold", DEMO, request_for(row), {}).use is CacheUse.LOOKUP  # one strike
    audited.clock.advance(10.0)
    (row, _, _), (key, cached) = rows[1], golds[1]
    await audited.hit("gold", key, request_for(row), cached)
    assert audited.mismatches("gold") == 2
    assert audited.gate.lookup("gold", DEMO, request_for(row), {}).use is CacheUse.BYPASS  # repeated: banned
    assert audited.gate.lookup("silver", DEMO, request_for(silver_row), {}).use is CacheUse.LOOKUP


async def test_audits_do_not_exceed_their_rate() -> None:
    audited = Audited(audit_rate=0.5, audit_burst=2)
    row, _, alone = batched_entry(audited.executor, 3)
    decoded = request_for(row)
    key, cached = await audited.cached("gold", decoded, alone)
    for _ in range(20):
        audited.auditor.on_hit("gold", key, DEMO, decoded, cached)
    await audited.auditor.drain()
    assert audited.executor.runs == [1, 1]  # the burst, however many hits
    audited.clock.advance(4.0)  # two more tokens
    for _ in range(20):
        audited.auditor.on_hit("gold", key, DEMO, decoded, cached)
    await audited.auditor.drain()
    assert len(audited.executor.runs) == 4
    assert audited.audits("match") == 4


async def test_audits_in_flight_are_bounded() -> None:
    audited = Audited(audit_max_inflight=2, audit_rate=1000.0, audit_burst=1000)
    release = asyncio.Event()
    run = audited.executor.infer

    async def held(*args: object, **kwargs: object) -> Reply:
        await release.wait()
        return await run(*args, **kwargs)  # type: ignore[arg-type]

    audited.executor.infer = held  # type: ignore[method-assign]
    row, _, alone = batched_entry(audited.executor, 4)
    decoded = request_for(row)
    key, cached = await audited.cached("gold", decoded, alone)
    for _ in range(10):
        audited.auditor.on_hit("gold", key, DEMO, decoded, cached)
    assert audited.auditor.budget.in_flight == 2
    release.set()
    await audited.auditor.drain()
    assert len(audited.executor.runs) == 2 and audited.auditor.budget.in_flight == 0


def test_a_calibration_repeats_the_rows_into_a_batch_the_model_accepts() -> None:
    decoded = request_for(np.ones(256, "<f4"))
    batch = calibration_request(decoded)
    assert batch is not None and batch.rows == 32 and batch.inputs[0].shape[0] == 32
    assert batch.inputs[0].data == decoded.inputs[0].data * 32
    unbatchable = dataclasses.replace(decoded, record=DEMO.model_copy(update={"max_batch_size": 1}))
    assert calibration_request(unbatchable) is None
