"""The stored form of a result: everything but the request id and the replay flag comes back, output
bytes byte for byte; anything else is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sluice_inference.common.pb.sluice.v1 import result_pb2
from sluice_inference.router.calls import CacheOutcome, InferResult, ServedBy, Tensor
from sluice_inference.router.stored_results import decode_result, encode_result

OUTPUTS = (
    Tensor("y", "FP32", (2, 3), np.random.default_rng(0).standard_normal((2, 3)).astype("<f4").tobytes()),
    Tensor("ids", "INT64", (2, 0), b""),
)


@pytest.mark.parametrize("served", [None, ServedBy("worker-7", 12, 0.0123456789)])
@pytest.mark.parametrize("cache", [None, *CacheOutcome])
def test_a_result_comes_back_whole_under_the_new_id(
    served: ServedBy | None, cache: CacheOutcome | None
) -> None:
    result = InferResult("mlp", "3", "original", OUTPUTS, served, cache, replayed=True)
    back = decode_result(encode_result(result), request_id="retry")
    assert back == dataclasses.replace(result, id="retry", replayed=False)
    assert [t.data for t in back.outputs] == [t.data for t in OUTPUTS]


def test_anything_but_a_stored_result_is_refused() -> None:
    truncated = encode_result(InferResult("mlp", "1", "", OUTPUTS, None))[:-3]
    for bad in (b"\xff\xff\xff", truncated):
        with pytest.raises(ValueError):
            decode_result(bad, request_id="x")


def test_an_unknown_cache_outcome_is_refused() -> None:
    blob = result_pb2.StoredResult(model_name="m", model_version="1", cache="maybe").SerializeToString()
    with pytest.raises(ValueError):
        decode_result(blob, request_id="x")
