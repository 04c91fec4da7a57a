"""Device copies: the CPU path runs the same steps a GPU runs (stage, copy, per-batch event, wait) with a
no-op event and no extra copies; on CUDA (skipped without one) copies round-trip through pinned memory
and the host waits on the batch's own event."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice_inference.worker.device_copies import CudaEvent, DeviceCopies, NoEvent

RNG = np.random.default_rng(11)


def test_cpu_inputs_are_zero_copy_views_of_the_arrays() -> None:
    copies = DeviceCopies(torch.device("cpu"))
    array = RNG.standard_normal((3, 4)).astype(np.float32)
    tensor = copies.to_device(array)
    assert copies.stream is None
    assert tensor.data_ptr() == array.ctypes.data  # no staging copy on the CPU
    assert torch.equal(tensor, torch.from_numpy(array))


def test_cpu_outputs_come_back_through_a_no_op_batch_event() -> None:
    copies = DeviceCopies(torch.device("cpu"))
    assert isinstance(copies.new_event(), NoEvent)
    produced = {"y": torch.arange(6.0).reshape(2, 3), "z": torch.ones(2, dtype=torch.int64)}
    hosts = copies.to_host(produced)
    assert set(hosts) == {"y", "z"}
    np.testing.assert_array_equal(hosts["y"], produced["y"].numpy())
    assert hosts["z"].dtype == np.int64
    assert hosts["y"].ctypes.data == produced["y"].data_ptr()  # already on the host: not copied again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip_is_stream_ordered() -> None:
    device = torch.device("cuda:0")
    copies = DeviceCopies(device)
    assert isinstance(copies.new_event(), CudaEvent)
    array = RNG.standard_normal((64, 128)).astype(np.float32)
    on_device = copies.to_device(array)
    torch.cuda.current_stream(device).wait_stream(copies.stream)
    hosts = copies.to_host({"y": on_device * 3})
    np.testing.assert_allclose(hosts["y"], array * 3, rtol=1e-6)
