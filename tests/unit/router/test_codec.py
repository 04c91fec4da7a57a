"""Request decoding (a KServe request → its domain call → a validated DecodedRequest): every malformed
request is INVALID_ARGUMENT naming the problem; raw == typed."""

from __future__ import annotations

import numpy as np
import pytest

from sluice_inference.common.errors import Code, SluiceError
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.records import ModelRecord, TensorSpec
from sluice_inference.router.calls import InferResult, ServedBy, Tensor
from sluice_inference.router.codec import DecodedRequest, DecodeLimits, decode_call, requested_outputs
from sluice_inference.router.kserve_codec import call_from_request, response_from_result

RECORD = ModelRecord(
    name="mlp",
    version="1",
    digest="sha256:00",
    platform="torch_export",
    max_batch_size=8,
    max_wait_s=0.002,
    inputs=(TensorSpec(name="input", datatype="FP32", dims=(4,)),),
    outputs=(
        TensorSpec(name="output", datatype="FP32", dims=(2,)),
        TensorSpec(name="aux", datatype="FP32", dims=(1,)),
    ),
)


def decode_infer_request(
    request: kserve.ModelInferRequest, record: ModelRecord, limits: DecodeLimits | None = None
) -> DecodedRequest:
    """What the servicer and the data plane do with a request, without a server."""
    call = call_from_request(request, metadata=None, time_remaining_s=None)
    return decode_call(call, record, limits or DecodeLimits())


def raw_request(values: np.ndarray, datatype: str = "FP32", name: str = "input") -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="mlp")
    request.inputs.add(name=name, datatype=datatype, shape=list(values.shape))
    request.raw_input_contents.append(values.tobytes())
    return request


def expect_invalid(request: kserve.ModelInferRequest, fragment: str) -> None:
    with pytest.raises(SluiceError) as caught:
        decode_infer_request(request, RECORD)
    assert caught.value.code == Code.INVALID_ARGUMENT
    assert fragment in caught.value.message


def test_raw_and_typed_contents_decode_to_the_same_bytes() -> None:
    values = np.arange(8, dtype="<f4").reshape(2, 4)
    typed = kserve.ModelInferRequest(model_name="mlp")
    tensor = typed.inputs.add(name="input", datatype="FP32", shape=[2, 4])
    tensor.contents.fp32_contents.extend(values.ravel().tolist())
    a = decode_infer_request(raw_request(values), RECORD)
    b = decode_infer_request(typed, RECORD)
    assert a.inputs == b.inputs and a.rows == b.rows == 2 and a.lane == b.lane


def test_wrong_datatype() -> None:
    expect_invalid(raw_request(np.zeros((1, 4), "<f8"), datatype="FP64"), "datatype")


def test_a_datatype_that_matches_nothing_is_repeated_only_in_part() -> None:
    with pytest.raises(SluiceError) as caught:
        decode_infer_request(raw_request(np.zeros((1, 4), "<f4"), datatype="F" * 100_000), RECORD)
    assert caught.value.reason == "bad_datatype" and len(caught.value.message) < 200


def test_wrong_fixed_dim() -> None:
    expect_invalid(raw_request(np.zeros((1, 5), "<f4")), "does not match")


def test_batch_too_large() -> None:
    expect_invalid(raw_request(np.zeros((9, 4), "<f4")), "between 1 and 8")


def test_buffer_size_mismatch() -> None:
    request = raw_request(np.zeros((1, 4), "<f4"))
    request.raw_input_contents[0] = b"\x00" * 15
    expect_invalid(request, "needs 16 bytes, got 15")


def test_unknown_input_name() -> None:
    expect_invalid(raw_request(np.zeros((1, 4), "<f4"), name="x"), "takes inputs")


def test_unknown_requested_output() -> None:
    request = raw_request(np.zeros((1, 4), "<f4"))
    request.outputs.add(name="nope")
    expect_invalid(request, "no output 'nope'")


def test_bad_timeout_parameter() -> None:
    request = raw_request(np.zeros((1, 4), "<f4"))
    request.parameters["timeout"].string_param = "soon"
    expect_invalid(request, "timeout")


def test_timeout_parameter_is_microseconds() -> None:
    request = raw_request(np.zeros((1, 4), "<f4"))
    request.parameters["timeout"].int64_param = 250_000
    assert decode_infer_request(request, RECORD).timeout_s == pytest.approx(0.25)


def test_response_keeps_only_requested_outputs_in_request_order() -> None:
    request = raw_request(np.zeros((1, 4), "<f4"))
    request.outputs.add(name="aux")
    decoded = decode_infer_request(request, RECORD)
    outputs = [
        Tensor("output", "FP32", (1, 2), b"\x00" * 8),
        Tensor("aux", "FP32", (1, 1), b"\x00" * 4),
    ]
    result = InferResult(
        model_name="mlp",
        model_version="1",
        id="",
        outputs=requested_outputs(decoded, outputs),
        served=ServedBy("w1", 3, 0.001),
    )
    response = response_from_result(result)
    assert [o.name for o in response.outputs] == ["aux"]
    assert response.parameters["sluice_batch_size"].int64_param == 3
    assert response.model_version == "1"


ENCODER = RECORD.model_copy(
    update={
        "name": "encoder",
        "inputs": (TensorSpec(name="tokens", datatype="INT64", dims=(-1,)),),
        "buckets": {"tokens": (16, 32)},
    }
)


def tokens_request(length: int) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="encoder")
    request.inputs.add(name="tokens", datatype="INT64", shape=[1, length])
    request.raw_input_contents.append(np.ones((1, length), "<i8").tobytes())
    return request


def test_variable_lengths_share_the_lane_of_their_bucket_and_cost_padded_elements() -> None:
    short, other_short, longer = (decode_infer_request(tokens_request(n), ENCODER) for n in (3, 16, 17))
    assert short.lane == other_short.lane != longer.lane
    assert (short.cost, longer.cost) == (16, 32)
    with pytest.raises(SluiceError, match="largest bucket"):
        decode_infer_request(tokens_request(33), ENCODER)


# ---------------------------------------------------------------- edge bounds (hostile input is input)


@pytest.mark.parametrize("value", [0, -5])
def test_a_timeout_that_is_not_positive_is_invalid_argument(value: int) -> None:
    request = raw_request(np.zeros((1, 4), "<f4"))
    request.parameters["timeout"].int64_param = value
    with pytest.raises(SluiceError) as caught:
        decode_infer_request(request, RECORD)
    assert caught.value.code == Code.INVALID_ARGUMENT and caught.value.reason == "bad_timeout"


def test_a_long_timeout_is_read_as_sent_and_left_to_the_deadline_budget_to_clamp() -> None:
    request = raw_request(np.zeros((1, 4), "<f4"))
    request.parameters["timeout"].uint64_param = 2**64 - 1
    assert decode_infer_request(request, RECORD).timeout_s == pytest.approx((2**64 - 1) * 1e-6)


def test_an_output_requested_twice_is_invalid_argument_and_costs_nothing() -> None:
    request = raw_request(np.zeros((1, 4), "<f4"))
    for _ in range(200_000):
        request.outputs.add(name="output")
    with pytest.raises(SluiceError) as caught:
        decode_infer_request(request, RECORD)
    assert caught.value.code == Code.INVALID_ARGUMENT and caught.value.reason == "duplicate_outputs"


def test_a_response_over_the_message_limit_is_refused_before_any_work() -> None:
    wide = RECORD.model_copy(
        update={"outputs": (TensorSpec(name="output", datatype="FP32", dims=(1024, 1024)),)}
    )
    request = raw_request(np.zeros((8, 4), "<f4"))  # 8 rows x 4 MiB of outputs = 32 MiB
    with pytest.raises(SluiceError) as caught:
        decode_infer_request(request, wide, DecodeLimits(max_response_bytes=16 * 1024 * 1024))
    assert caught.value.code == Code.INVALID_ARGUMENT and caught.value.reason == "response_too_large"
    small = decode_infer_request(raw_request(np.zeros((2, 4), "<f4")), wide)
    assert small.response_bytes >= 2 * 4 * 1024 * 1024


def test_integer_inputs_outside_their_declared_range_are_invalid_argument() -> None:
    ranged = ENCODER.model_copy(
        update={"inputs": (TensorSpec(name="tokens", datatype="INT64", dims=(-1,), range=(0, 999)),)}
    )
    ok = tokens_request(4)
    assert decode_infer_request(ok, ranged).rows == 1
    for bad in (1000, -1, 2**62):
        request = kserve.ModelInferRequest(model_name="encoder")
        request.inputs.add(name="tokens", datatype="INT64", shape=[1, 3])
        request.raw_input_contents.append(np.array([[1, bad, 2]], "<i8").tobytes())
        with pytest.raises(SluiceError) as caught:
            decode_infer_request(request, ranged)
        assert caught.value.code == Code.INVALID_ARGUMENT and caught.value.reason == "out_of_range"


def test_a_hostile_shape_gets_a_short_message() -> None:
    request = kserve.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="input", datatype="FP32", shape=[1] * 100_000)
    request.raw_input_contents.append(b"")
    with pytest.raises(SluiceError) as caught:
        decode_infer_request(request, RECORD)
    assert caught.value.code == Code.INVALID_ARGUMENT and len(caught.value.message) < 300


def test_a_replaced_record_is_decoded_by_its_own_specs_not_the_layout_of_the_one_before() -> None:
    """Layouts are worked out once per record: a worker re-registering the same name and version with
    other specs (a redeploy) must be validated against the new record at once."""
    assert decode_infer_request(raw_request(np.zeros((1, 4), "<f4")), RECORD).rows == 1
    wider = RECORD.model_copy(update={"inputs": (TensorSpec(name="input", datatype="FP32", dims=(6,)),)})
    assert decode_infer_request(raw_request(np.zeros((2, 6), "<f4")), wider).rows == 2
    with pytest.raises(SluiceError, match="does not match"):
        decode_infer_request(raw_request(np.zeros((1, 4), "<f4")), wider)
    short = raw_request(np.zeros((1, 6), "<f4"))
    short.raw_input_contents[0] = b"\x00" * 20
    with pytest.raises(SluiceError, match="needs 24 bytes, got 20"):
        decode_infer_request(short, wider)


def test_raw_and_typed_inputs_of_a_fixed_shape_model_land_in_one_lane_at_one_cost() -> None:
    values = np.arange(12, dtype="<f4").reshape(3, 4)
    typed = kserve.ModelInferRequest(model_name="mlp")
    typed.inputs.add(name="input", datatype="FP32", shape=[3, 4]).contents.fp32_contents.extend(
        values.ravel().tolist()
    )
    raw, from_typed = decode_infer_request(raw_request(values), RECORD), decode_infer_request(typed, RECORD)
    assert raw.lane == from_typed.lane and raw.lane.shape == (("input", (4,)),)
    assert (raw.cost, raw.response_bytes, raw.input_bytes) == (3, from_typed.response_bytes, 48)
