"""The minimal path (bench/minimal_path.py), started as bench/minimal_two_tenant.py starts it: its router
serves gold through the worker's forward, and its oracle door refuses bronze with a retry hint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice_inference.bench.minimal_path import BRONZE_AUTH, GOLD_AUTH, running_minimal_path
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc

pytestmark = pytest.mark.integration

ROW = np.arange(16, dtype="<f4").reshape(1, 16)


def request() -> kserve.ModelInferRequest:
    """One FP32 [1, 16] row, 0..15."""
    message = kserve.ModelInferRequest(model_name="synthetic", id="call-1")
    message.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    message.raw_input_contents.append(ROW.tobytes())
    return message


async def gold_then_bronze(target: str) -> tuple[kserve.ModelInferResponse, grpc.aio.AioRpcError]:
    """One gold call (its answer) and one bronze call (its error)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        gold = await stub.ModelInfer(request(), timeout=5, metadata=(("authorization", GOLD_AUTH),))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ModelInfer(request(), timeout=5, metadata=(("authorization", BRONZE_AUTH),))
    return gold, refused.value


def test_the_oracle_door_serves_gold_and_refuses_bronze_with_a_hint(tmp_path: Path) -> None:
    with running_minimal_path(door=True, core=None, log_dir=tmp_path) as path:
        gold, bronze = asyncio.run(gold_then_bronze(path.target))
    assert (gold.model_name, gold.id) == ("synthetic", "call-1")
    assert [(o.name, o.datatype, list(o.shape)) for o in gold.outputs] == [("y", "FP32", [1, 16])]
    np.testing.assert_array_equal(np.frombuffer(gold.raw_output_contents[0], "<f4"), 2 * ROW.ravel())
    assert bronze.code() == grpc.StatusCode.UNAVAILABLE
    assert ("grpc-retry-pushback-ms", "100") in tuple(bronze.trailing_metadata() or ())
    assert path.router.process.poll() is not None and path.worker.process.poll() is not None


async def latencies(target: str, rows: int) -> tuple[float, kserve.ModelInferResponse]:
    """One call of `rows` rows: how long it took, and its answer."""
    message = kserve.ModelInferRequest(model_name="synthetic", id="held")
    message.inputs.add(name="x", datatype="FP32", shape=[rows, 16])
    message.raw_input_contents.append(np.ones((rows, 16), "<f4").tobytes())
    async with grpc.aio.insecure_channel(target) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        await stub.ModelInfer(request(), timeout=10)  # the stream to the worker is open after this
        started = asyncio.get_running_loop().time()
        answer = await stub.ModelInfer(message, timeout=10)
        return asyncio.get_running_loop().time() - started, answer


def test_a_held_batch_waits_for_its_oldest_call_or_leaves_full(tmp_path: Path) -> None:
    hold_s = 1.0
    with running_minimal_path(door=False, core=None, log_dir=tmp_path, hold_ms=hold_s * 1000) as path:
        alone, one_row = asyncio.run(latencies(path.target, 1))
        full, full_rows = asyncio.run(latencies(path.target, 32))
    # The hold is measured on the router's monotonic clock from the call's arrival, so a lone row waits it
    # out whatever the machine's speed; a full batch leaves at once (a 1 s margin for a stalled machine).
    assert alone >= hold_s
    assert full < hold_s
    assert np.frombuffer(one_row.raw_output_contents[0], "<f4").tolist() == [2.0] * 16
    assert np.frombuffer(full_rows.raw_output_contents[0], "<f4").shape == (32 * 16,)
