"""Cache keys and fingerprints: every field that can change the output changes the key; nothing else does."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.records import ModelRecord, TensorSpec
from sluice_inference.router.codec import decode_call
from sluice_inference.router.kserve_codec import call_from_request
from sluice_inference.router.policy.cache_keys import (
    OUTPUT_AFFECTING_EXCLUDED,
    TensorBytes,
    cache_key,
    cache_scope,
    request_fingerprint,
    tensors_from,
)

X = TensorBytes("x", "FP32", (1, 2), np.array([[1.0, 2.0]], "<f4").tobytes())
MASK = TensorBytes("mask", "INT64", (1, 3), np.array([[1, 1, 0]], "<i8").tobytes())

BASE: dict[str, Any] = {
    "scope": "tenant:gold",
    "model": "mlp",
    "version": "1",
    "model_digest": "sha256:aa",
    "inputs": (X, MASK),
    "outputs": ("y",),
    "parameters": {"temperature": 0.5},
}


def key(**changes: Any) -> str:
    return cache_key(**{**BASE, **changes})


def test_key_is_a_sha256_hex_digest_and_stable() -> None:
    assert key() == key()
    assert len(key()) == 64 and int(key(), 16) >= 0


@pytest.mark.parametrize(
    "changes",
    [
        {"scope": "tenant:silver"},
        {"scope": "shared"},
        {"model": "mlp2"},
        {"version": "2"},
        {"model_digest": "sha256:ab"},
        {"outputs": ("z",)},
        {"outputs": ()},
        {"outputs": ("y", "z")},
        {"parameters": {"temperature": 0.6}},
        {"parameters": {}},
        {"parameters": {"temperature": 0.5, "top_k": 3}},
    ],
    ids=",".join,
)
def test_each_field_changes_the_key(changes: dict[str, Any]) -> None:
    assert key(**changes) != key()


def test_a_single_byte_dtype_or_shape_change_changes_the_key() -> None:
    data = bytearray(X.data)
    data[-1] ^= 1
    variants = [
        dataclasses.replace(X, data=bytes(data)),
        dataclasses.replace(X, datatype="INT32"),  # same bytes, other meaning
        dataclasses.replace(X, shape=(2, 1)),  # same bytes, other shape
        dataclasses.replace(X, name="x2"),
    ]
    for variant in variants:
        assert key(inputs=(variant, MASK)) != key(), variant


def test_input_order_does_not_matter() -> None:
    assert key(inputs=(MASK, X)) == key(inputs=(X, MASK))


def test_output_order_matters_because_the_response_lists_outputs_in_requested_order() -> None:
    assert key(outputs=("a", "b")) != key(outputs=("b", "a"))


def test_excluded_parameters_do_not_change_the_key() -> None:
    assert {"priority", "timeout", "cache"} == OUTPUT_AFFECTING_EXCLUDED
    noisy = {"temperature": 0.5, "priority": 1, "timeout": 5000, "cache": True}
    assert key(parameters=noisy) == key()


def test_parameter_values_are_typed() -> None:
    keys = {key(parameters={"p": v}) for v in (True, 1, 1.0, "1")}
    assert len(keys) == 4


def test_field_boundaries_are_unambiguous() -> None:
    assert key(model="ab", version="c") != key(model="a", version="bc")
    two = (TensorBytes("a", "UINT8", (1,), b"\x01"), TensorBytes("b", "UINT8", (1,), b"\x02"))
    one = (TensorBytes("a", "UINT8", (2,), b"\x01\x02"),)
    assert key(inputs=two) != key(inputs=one)


def test_tenant_scope_cannot_impersonate_shared() -> None:
    assert cache_scope("shared", shared=False) == "tenant:shared"
    assert cache_scope("gold", shared=True) == "shared"
    assert key(scope=cache_scope("shared", shared=False)) != key(scope="shared")
    with pytest.raises(ValueError):
        key(scope="gold")  # a bare tenant name is refused


def test_duplicate_input_names_are_refused() -> None:
    with pytest.raises(ValueError):
        key(inputs=(X, X))


def test_fingerprint_uses_the_requested_version_and_differs_from_the_cache_key() -> None:
    common: dict[str, Any] = {
        "model": "mlp",
        "inputs": (X,),
        "outputs": ("y",),
        "parameters": {"priority": 3},
    }
    latest = request_fingerprint(requested_version="", **common)
    pinned = request_fingerprint(requested_version="1", **common)
    assert latest != pinned
    retry = {**common, "parameters": {"priority": 1, "timeout": 100, "cache": False}}
    assert request_fingerprint(requested_version="", **retry) == latest
    assert latest != key(inputs=(X,), parameters={})


# ------------------------------------------------------ end to end: raw and typed contents share a key

RECORD = ModelRecord(
    name="enc",
    version="3",
    digest="sha256:cd",
    platform="torch_export",
    max_batch_size=4,
    max_wait_s=0.001,
    inputs=(
        TensorSpec(name="ids", datatype="INT64", dims=(-1,)),
        TensorSpec(name="weights", datatype="FP32", dims=(3,)),
    ),
    outputs=(TensorSpec(name="emb", datatype="FP32", dims=(2,)),),
)
IDS = np.array([[7, 8, 9, 10]], "<i8")
WEIGHTS = np.array([[0.25, -1.5, 3.0]], "<f4")


def _request(*, typed: bool) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="enc")
    # Different input order in the two requests, too: the key must not care.
    ordered = [("ids", "INT64", IDS), ("weights", "FP32", WEIGHTS)]
    for name, datatype, values in ordered if typed else ordered[::-1]:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(values.shape))
        if typed:
            field = tensor.contents.int64_contents if datatype == "INT64" else tensor.contents.fp32_contents
            field.extend(values.ravel().tolist())
        else:
            request.raw_input_contents.append(values.tobytes())
    request.outputs.add(name="emb")
    return request


def _key_of(request: kserve.ModelInferRequest) -> str:
    decoded = decode_call(call_from_request(request, metadata=None, time_remaining_s=None), RECORD)
    return cache_key(
        scope=cache_scope("gold", shared=False),
        model=decoded.record.name,
        version=decoded.record.version,
        model_digest=decoded.record.digest,
        inputs=tensors_from(decoded.inputs),
        outputs=decoded.outputs,
        parameters={},
    )


def test_typed_and_raw_contents_give_the_same_key_through_the_codec() -> None:
    assert _key_of(_request(typed=True)) == _key_of(_request(typed=False))


def test_a_different_value_through_the_codec_gives_a_different_key() -> None:
    other = _request(typed=True)
    other.inputs[1].contents.fp32_contents[0] = 0.5
    assert _key_of(other) != _key_of(_request(typed=False))
