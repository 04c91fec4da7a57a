"""KServe v2 messages ↔ domain objects: conversion passes what the client sent on unchecked and never
raises (validation is the data plane's), and a result's serving facts become the response parameters."""

from __future__ import annotations

import numpy as np
import pytest

from sluice_inference.common.errors import Code, SluiceError
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.router.calls import CacheOutcome, InferResult, ServedBy, Tensor
from sluice_inference.router.kserve_codec import api_key, call_from_request, response_from_result

VALUES = np.arange(8, dtype="<f4").reshape(2, 4)


def request(*, typed: bool) -> kserve.ModelInferRequest:
    message = kserve.ModelInferRequest(model_name="mlp", model_version="2", id="r-1")
    tensor = message.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    if typed:
        tensor.contents.fp32_contents.extend(VALUES.ravel().tolist())
    else:
        message.raw_input_contents.append(VALUES.tobytes())
    message.outputs.add(name="y")
    message.parameters["priority"].int64_param = 2
    message.parameters["tag"].string_param = "a"
    message.parameters["unset"].SetInParent()
    return message


def test_a_request_becomes_the_call_it_asks_for() -> None:
    metadata = (("authorization", "Bearer k-1"), ("idempotency-key", "order-9"))
    call = call_from_request(request(typed=False), metadata=metadata, time_remaining_s=1.5)
    assert (call.model_name, call.model_version, call.id, call.outputs) == ("mlp", "2", "r-1", ("y",))
    assert (call.api_key, call.idempotency_key, call.time_remaining_s) == ("k-1", "order-9", 1.5)
    assert call.parameters == {"priority": 2, "tag": "a", "unset": None}
    (x,) = call.inputs
    assert (x.name, x.datatype, x.shape, x.data, x.values) == ("x", "FP32", (2, 4), VALUES.tobytes(), None)
    assert call.body_bytes == request(typed=False).ByteSize() and call.defect is None


def test_typed_contents_are_passed_as_values_of_the_declared_datatype() -> None:
    (x,) = call_from_request(request(typed=True), metadata=None, time_remaining_s=None).inputs
    assert x.data is None and x.values is not None and list(x.values) == VALUES.ravel().tolist()


def test_raw_buffers_that_do_not_pair_with_the_inputs_are_a_defect_not_an_exception() -> None:
    message = request(typed=False)
    message.raw_input_contents.append(b"extra")
    call = call_from_request(message, metadata=None, time_remaining_s=None)
    assert call.defect is not None and call.defect.reason == "bad_inputs"
    assert all(t.data is None and t.values is None for t in call.inputs)


def test_a_malformed_authorization_header_is_unauthenticated() -> None:
    with pytest.raises(SluiceError) as caught:
        api_key([("authorization", "Basic abc")])
    assert (caught.value.code, caught.value.reason) == (Code.UNAUTHENTICATED, "bad_auth_header")
    assert api_key(None) is None


Y = Tensor("y", "FP32", (1, 2), b"\x00\x00\x80?\x00\x00\x00@")


def test_a_served_result_reports_worker_batch_and_queue_time() -> None:
    response = response_from_result(
        InferResult("mlp", "2", "r-1", (Y,), ServedBy("w-3", 5, 0.0012345), CacheOutcome.MISS)
    )
    assert (response.model_name, response.model_version, response.id) == ("mlp", "2", "r-1")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [("y", "FP32", [1, 2])]
    assert list(response.raw_output_contents) == [Y.data]
    params = response.parameters
    assert params["sluice_batch_size"].int64_param == 5 and params["sluice_worker"].string_param == "w-3"
    assert params["sluice_queue_us"].int64_param == 1234 and params["sluice_cache"].string_param == "miss"
    assert "sluice_replayed" not in params


def test_a_hit_and_a_replay_report_only_what_is_true_of_them() -> None:
    hit = response_from_result(InferResult("mlp", "2", "r", (Y,), None, CacheOutcome.HIT, replayed=True))
    assert set(hit.parameters) == {"sluice_cache", "sluice_replayed"}
    assert hit.parameters["sluice_replayed"].bool_param
    uncached = response_from_result(InferResult("mlp", "2", "r", (Y,), ServedBy("w", 1, 0.0)))
    assert "sluice_cache" not in uncached.parameters
