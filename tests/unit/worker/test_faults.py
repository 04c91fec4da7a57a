"""Device faults: what counts as one, and what the executor does after one (answer, then never again)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice_inference.common.errors import Code, Internal
from sluice_inference.worker.backends.synthetic import POISON, SIMULATED_FAULT, SyntheticBackend
from sluice_inference.worker.executor import ExecItem, Executor
from sluice_inference.worker.faults import is_fatal_device_error
from sluice_inference.worker.model_config import ModelConfig
from tests.unit.worker.fakes import CountingBackend, RaisingBackend, fake_model, synthetic_config

HINT = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
    "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)  # what torch appends to CUDA errors


def caused_by(cause: BaseException) -> Internal:
    """An error raised while handling `cause` and chained to it, as the executor wraps model errors."""
    try:
        raise cause
    except BaseException as exc:
        error = Internal("model failed")
        error.__cause__ = exc
        return error


def cpu_embedding_index_error() -> BaseException:
    """What a real out-of-range embedding index raises on a CPU (on CUDA it is a device-side assert)."""
    try:
        torch.nn.Embedding(10, 4)(torch.tensor([11]))
    except IndexError as exc:
        return exc
    raise AssertionError("expected an IndexError")


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA error: device-side assert triggered" + HINT),
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered" + HINT),
        RuntimeError("CUDA error: unspecified launch failure" + HINT),
        RuntimeError("CUDA error: misaligned address"),
        RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, ...)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
        caused_by(RuntimeError("CUDA error: device-side assert triggered")),
    ],
    ids=repr,
)
def test_sticky_device_errors_are_fatal(exc: BaseException) -> None:
    assert is_fatal_device_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        cpu_embedding_index_error(),
        RuntimeError("synthetic model: poison input (first value = POISON) in this batch"),
        RuntimeError(
            "The size of tensor a (5) must match the size of tensor b (4) at non-singleton dimension 1"
        ),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.35 GiB total)"),
        RuntimeError(
            "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmStridedBatchedEx(...)`"
        ),
        ValueError("device-side assert triggered"),  # right words, but not what torch raises
        KeyError("an illegal memory access was encountered"),
        caused_by(ValueError("bad item")),
    ],
    ids=repr,
)
def test_ordinary_model_errors_are_not_fatal(exc: BaseException) -> None:
    assert not is_fatal_device_error(exc)


def test_a_device_fault_fails_the_batch_on_the_worker_and_the_device_is_never_used_again() -> None:
    backend = RaisingBackend(RuntimeError("CUDA error: device-side assert triggered" + HINT))
    model = fake_model(synthetic_config(max_batch_size=8), backend)
    executor = Executor()
    items = [ExecItem(i, {"x": np.ones((1, 4), np.float32)}) for i in range(8)]
    outcomes = executor.run(model, items)
    assert backend.calls == 1  # no bisection, no canary: every further call would fail the same way
    assert executor.fault is not None and executor.fault.reason == "device_fault"
    for outcome in outcomes:
        assert outcome.error is executor.fault and outcome.worker_fault
        assert outcome.error.code == Code.INTERNAL and "device-side assert" in outcome.error.message
    later = executor.run(model, items[:2])
    assert backend.calls == 1 and all(o.error is executor.fault and o.worker_fault for o in later)


def test_items_already_isolated_before_a_fault_are_blamed_on_the_worker_too() -> None:
    """A fault met while bisecting: CUDA reports errors late, so no item of the batch can be singled out."""
    config = synthetic_config(
        max_batch_size=8, synthetic={"base_ms": 0, "per_item_ms": 0, "fault_trigger": 7.0}
    )
    backend = CountingBackend(SyntheticBackend(ModelConfig.model_validate(config), "cpu"))
    # Item 0 fails first (poison: the client's), then item 7 breaks the device.
    values = [POISON, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    items = [ExecItem(i, {"x": np.full((1, 4), v, "<f4")}) for i, v in enumerate(values)]
    executor = Executor()
    outcomes = executor.run(fake_model(config, backend), items)
    assert executor.fault is not None
    failed = [o for o in outcomes if o.error is not None]
    assert failed and all(o.worker_fault for o in failed)
    assert [o.item_id for o in outcomes if o.error is None] == [1, 2, 3]  # passed before the fault: kept


def test_simulated_fault_is_sticky_like_a_cuda_context() -> None:
    config = ModelConfig.model_validate(
        synthetic_config(synthetic={"base_ms": 0, "per_item_ms": 0, "fault_trigger": 7.0})
    )
    backend = SyntheticBackend(config, "cpu")
    fine = {"x": torch.ones((1, 4))}
    assert backend.forward(fine)["y"].shape == (1, 4)
    with pytest.raises(RuntimeError, match="device-side assert") as info:
        backend.forward({"x": torch.full((2, 4), 7.0)})
    assert is_fatal_device_error(info.value) and SIMULATED_FAULT in str(info.value)
    with pytest.raises(RuntimeError, match="device-side assert"):
        backend.forward(fine)
