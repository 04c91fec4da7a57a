"""One trace per request: client span → router `sluice.infer` → `sluice.batch` (linked to every request
it carries) → worker `sluice.execute`, with context in gRPC metadata and in the batch message. Router and
worker run in-process here so one in-memory exporter sees every span."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.serving_settings import RouterSettings, WorkerSettings
from sluice_inference.common.telemetry import inject
from sluice_inference.common.trust_settings import ClusterSettings, EtcdSettings
from sluice_inference.router.main import RouterServer
from sluice_inference.worker.main import WorkerProcess
from tests.support.processes import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def traced(
    etcd_settings: EtcdSettings,
    cluster_settings: ClusterSettings,
    demo_repo: Path,
    exporter: InMemorySpanExporter,
) -> AsyncIterator[tuple[RouterServer, TracerProvider]]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = SluiceConfig(
        etcd=etcd_settings,
        cluster=cluster_settings,
        router=RouterSettings(listen="127.0.0.1:0", metrics_port=0),
        worker=WorkerSettings(repository=demo_repo, models=["synthetic"], worker_id="w-traced"),
    )
    router = RouterServer(config, tracer_provider=provider)
    worker = WorkerProcess(config, tracer_provider=provider)
    await router.start()
    await worker.start()
    try:
        await eventually(lambda: router.driver.core.accepting("w-traced"), 30, "worker accepted")
        yield router, provider
    finally:
        await worker.stop(grace=0.1)
        await router.stop(grace=0.1)


async def test_span_tree_from_client_to_worker(
    traced: tuple[RouterServer, TracerProvider], exporter: InMemorySpanExporter
) -> None:
    router, provider = traced
    client = provider.get_tracer("test-client")
    request = kserve.ModelInferRequest(model_name="synthetic", id="traced-1")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.ones((1, 16), "<f4").tobytes())
    with client.start_as_current_span("client-call") as parent:
        metadata = tuple(inject(parent).items())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            await asyncio.gather(*(stub.ModelInfer(request, metadata=metadata, timeout=10) for _ in range(3)))
    await eventually(
        lambda: any(s.name == "sluice.batch" for s in exporter.get_finished_spans()), 5, "batch span"
    )
    spans = exporter.get_finished_spans()
    by_name: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    infers = by_name["sluice.infer"]
    assert len(infers) == 3
    assert all(s.parent is not None and s.parent.span_id == parent.get_span_context().span_id for s in infers)
    assert {s.context.trace_id for s in infers} == {parent.get_span_context().trace_id}
    linked = {link.context.span_id for b in by_name["sluice.batch"] for link in b.links}
    assert {s.context.span_id for s in infers} <= linked  # every request is linked from its batch
    batch_ids = {b.context.span_id for b in by_name["sluice.batch"]}
    executes = by_name["sluice.execute"]
    assert executes and all(e.parent is not None and e.parent.span_id in batch_ids for e in executes)
