"""Copies between host arrays and one device, ordered by streams and events instead of device-wide syncs.

Rules:
- inputs go host → device on the copy stream (CUDA), from a pinned host buffer, without blocking the
  host: the copy of the next batch overlaps the forward of this one; the executor makes the compute stream
  wait for the copy stream's per-batch event before the forward (worker/executor.py, `prepare`);
- outputs go device → host on the compute stream that produced them, into pinned buffers, and the host
  waits on one event recorded after those copies: it waits for this batch's work on that stream only,
  never for the whole device (`torch.cuda.synchronize` would also wait for the next batch's input copy);
- the CPU path runs the same steps with no stream and a no-op event, so the CPU rehearsal and the unit
  tests exercise the code a GPU runs; there, inputs stay zero-copy views of the arrays and outputs already
  on the host are not copied again.
Freed pinned buffers go back to torch's caching host allocator, which reuses one only once the copies
that used it have finished (it records an event per non-blocking copy), so a buffer never needs to be
held here past the call that made it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import numpy.typing as npt
import torch

Array = npt.NDArray[Any]
_NO_STREAM = contextlib.nullcontext()
"""The CPU's copy stream: nothing to enter (one shared object, not a context manager per copy)."""


class BatchEvent(Protocol):
    """The point in a stream after one batch's copies: recorded once, then waited on by the host."""

    def record(self) -> None:
        """Mark the current stream's position."""

    def synchronize(self) -> None:
        """Block the host until the stream has passed the mark."""


class NoEvent:
    """The CPU's event: every copy has finished when its call returns, so there is nothing to wait for."""

    def record(self) -> None:
        """Nothing to mark: CPU copies are synchronous."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


class CudaEvent:
    """A CUDA event on the current stream of one device."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def record(self) -> None:
        """Mark the current stream of the device (the one the forward ran on)."""
        self._event.record(torch.cuda.current_stream(self._device))

    def synchronize(self) -> None:
        """Block until this batch's copies are done; later work on any stream keeps running."""
        self._event.synchronize()


class DeviceCopies:
    """Host ↔ device copies for one executor's device (one per Executor; used from its device thread)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]

    def new_event(self) -> BatchEvent:
        """A fresh per-batch event for this device (a no-op on the CPU)."""
        return CudaEvent(self.device) if self._cuda else NoEvent()

    def to_device(self, array: Array) -> torch.Tensor:
        """`array` on the device; on CUDA the copy is queued on the copy stream and may still be running."""
        with torch.cuda.stream(self.stream) if self._cuda else _NO_STREAM:
            on_device = self._staged(array).to(self.device, non_blocking=self._cuda)
        if self._cuda:
            # The compute stream uses the result: the caching allocator must not hand its memory to
            # another tensor until the compute stream is done with it.
            on_device.record_stream(torch.cuda.current_stream(self.device))
        return on_device

    def to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, Array]:
        """The tensors as host arrays, once this batch's copies have finished (and only those)."""
        hosts = {name: self._host_copy(tensor.detach()) for name, tensor in tensors.items()}
        done = self.new_event()
        done.record()
        done.synchronize()
        return {name: host.numpy() for name, host in hosts.items()}

    def _staged(self, array: Array) -> torch.Tensor:
        """The host tensor the copy reads: the array itself on the CPU, a pinned copy of it on CUDA
        (an asynchronous host → device copy needs page-locked memory)."""
        tensor = torch.from_numpy(array)
        if not self._cuda:
            return tensor
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor)
        return pinned

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor holding `tensor` (itself when it is already on the host)."""
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host
