"""The KServe servicer on a real in-process gRPC server, over a real data plane whose driver is a fake:
the servicer only translates, so a stream request and a unary request make the same domain call, and a
domain error reaches the client as its status, reason trailer and retry hint, out of band or in band."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from sluice_inference.common.errors import Unavailable
from sluice_inference.common.grpc_errors import PUSHBACK_KEY, REASON_KEY
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.router.calls import InferCall, InferResult
from sluice_inference.router.dataplane import DataPlane
from sluice_inference.router.edge import MalformedBodies, add_service
from sluice_inference.router.servicer import InferenceServicer
from tests.support.dataplane import GOLD_KEY, Plane, make_plane

pytestmark = pytest.mark.integration

SERVICE = kserve.DESCRIPTOR.services_by_name["GRPCInferenceService"]
METADATA = (("authorization", f"Bearer {GOLD_KEY}"),)


class RecordingPlane(DataPlane):
    """The real data plane, keeping every call the servicer hands it."""

    calls: list[InferCall]

    async def infer(self, call: InferCall) -> InferResult:
        self.calls = [*getattr(self, "calls", []), call]
        return await super().infer(call)


@dataclass
class Served:
    made: Plane
    stub: kserve_grpc.GRPCInferenceServiceAsyncStub

    @property
    def calls(self) -> list[InferCall]:
        plane = self.made.plane
        assert isinstance(plane, RecordingPlane)
        return plane.calls


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    made = make_plane(plane_type=RecordingPlane)
    server = grpc.aio.server()
    bodies = MalformedBodies(made.clock)
    servicer = InferenceServicer(
        made.plane, settings=RouterSettings(), malformed=bodies, inflight_bytes=made.budget
    )
    add_service(server, SERVICE, servicer, bodies)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Served(made, kserve_grpc.GRPCInferenceServiceStub(channel))
    finally:
        await server.stop(0)


def infer_request(model: str = "mlp") -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name=model, id="req-1")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.arange(4, dtype="<f4").reshape(1, 4).tobytes())
    request.parameters["tag"].string_param = "t"
    return request


async def stream_one(served: Served, request: kserve.ModelInferRequest) -> kserve.ModelStreamInferResponse:
    answers = [a async for a in served.stub.ModelStreamInfer(iter([request]), metadata=METADATA, timeout=10)]
    assert len(answers) == 1
    return answers[0]


async def test_a_stream_request_and_a_unary_request_make_the_same_domain_call(served: Served) -> None:
    unary = await served.stub.ModelInfer(infer_request(), metadata=METADATA, timeout=10)
    streamed = await stream_one(served, infer_request())
    first, second = (dataclasses.replace(c, time_remaining_s=None) for c in served.calls)
    assert first == second
    assert first.api_key == GOLD_KEY and first.parameters == {"tag": "t"} and first.model_name == "mlp"
    # The 10 s gRPC deadline reaches both calls (upper tolerance 1 s: gRPC rounds deadlines it carries).
    assert all(c.time_remaining_s is not None and 0 < c.time_remaining_s < 11 for c in served.calls)
    # ...and answer alike: the second was a cache hit, byte for byte the first's outputs.
    answer = streamed.infer_response
    assert answer.raw_output_contents == unary.raw_output_contents and answer.id == unary.id == "req-1"
    assert [r.parameters["sluice_cache"].string_param for r in (unary, answer)] == ["miss", "hit"]
    assert unary.parameters["sluice_worker"].string_param == "fake-1"
    assert "sluice_worker" not in answer.parameters


async def test_a_domain_error_reaches_the_client_as_its_status_reason_and_retry_hint(served: Served) -> None:
    served.made.backend.errors = [Unavailable("no ready worker", reason="no_worker", retry_after_s=0.25)]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await served.stub.ModelInfer(infer_request(), metadata=METADATA, timeout=10)
    trailers = dict(caught.value.trailing_metadata() or ())
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and caught.value.details() == "no ready worker"
    assert (trailers[REASON_KEY], trailers[PUSHBACK_KEY]) == ("no_worker", "250")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await served.stub.ModelInfer(infer_request("nope"), metadata=METADATA, timeout=10)
    trailers = dict(caught.value.trailing_metadata() or ())
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert (trailers[REASON_KEY], trailers[PUSHBACK_KEY]) == ("unknown_model", "-1")


async def test_a_stream_answers_the_same_error_in_band(served: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await served.stub.ModelInfer(infer_request("nope"), metadata=METADATA, timeout=10)
    answer = await stream_one(served, infer_request("nope"))
    assert answer.error_message == f"NOT_FOUND: {caught.value.details()}"
    assert (answer.infer_response.model_name, answer.infer_response.id) == ("nope", "req-1")


async def test_model_queries_go_through_the_data_plane(served: Served) -> None:
    ready = await served.stub.ModelReady(kserve.ModelReadyRequest(name="mlp"), metadata=METADATA)
    metadata = await served.stub.ModelMetadata(kserve.ModelMetadataRequest(name="mlp"), metadata=METADATA)
    assert ready.ready and list(metadata.versions) == ["1"]
    assert [(t.name, list(t.shape)) for t in metadata.inputs] == [("x", [-1, 4])]
    assert (await served.stub.ServerReady(kserve.ServerReadyRequest())).ready
    served.made.roll_out()  # no worker serves anything now
    assert not (await served.stub.ServerReady(kserve.ServerReadyRequest())).ready
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await served.stub.ModelMetadata(kserve.ModelMetadataRequest(name="mlp"), metadata=METADATA)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
