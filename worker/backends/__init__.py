"""Backends: what turns a batch of tensors into outputs for one model version on one device.

`torch_export` (`.pt2`) is the primary format; `torchscript` (`.pt`, deprecated by PyTorch, Triton's
`pytorch_libtorch`) and `onnxruntime` (`.onnx`, Triton's `onnxruntime_onnx`; needs the `onnx` extra) serve
models exported elsewhere; `synthetic` is a SIMULATED latency profile for scheduling benchmarks.
`load_backend` is the only constructor callers use; a loading failure (a corrupt artifact, a config that
does not fit the model's signature, a device the model cannot use) raises RepositoryError naming the
artifact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sluice_inference.worker.backends.base import Backend
from sluice_inference.worker.backends.boundary import at_boundary
from sluice_inference.worker.backends.synthetic import SyntheticBackend
from sluice_inference.worker.backends.torch_export import TorchExportBackend
from sluice_inference.worker.backends.torchscript import TorchScriptBackend
from sluice_inference.worker.repository import ModelVersionSpec, RepositoryError

__all__ = ["Backend", "load_backend", "model_device"]


def model_device(spec: ModelVersionSpec, worker_device: str) -> str:
    """Where `spec` runs on a worker that owns `worker_device` (config `device`, Triton's instance kind)."""
    kind = spec.config.device
    if kind == "cpu":
        return "cpu"
    if kind == "gpu" and torch.device(worker_device).type != "cuda":
        message = f"device: gpu (Triton KIND_GPU) needs a CUDA worker, this one has {worker_device}"
        raise RepositoryError(message, path=spec.config_path or Path(spec.name))
    return worker_device


def load_backend(spec: ModelVersionSpec, device: str, synthetic_slowdown: float = 1.0) -> Backend:
    """Load `spec`'s artifact for a worker on `device` with the backend its config names."""
    config = spec.config
    if config.backend == "synthetic":
        return SyntheticBackend(config, device, synthetic_slowdown)
    if spec.artifact is None:
        message = f"backend {config.backend} needs an artifact"
        raise RepositoryError(message, path=Path(spec.name, spec.version))
    placed = model_device(spec, device)
    try:
        backend = _load(spec, spec.artifact, placed)
    except ImportError as exc:
        message = (
            f"backend {config.backend} is not installed ({exc.name}): pip install 'sluice-inference[onnx]'"
        )
        raise RepositoryError(message, path=spec.artifact) from exc
    except Exception as exc:
        # torch and onnxruntime raise many unrelated types for a corrupt or incompatible file (BadZipFile,
        # RuntimeError, pickle errors, their own exception classes...), and the binding checks raise
        # ValueError; all of them mean the same to the operator: this artifact cannot be served.
        raise RepositoryError(f"cannot load with {config.backend}: {exc}", path=spec.artifact) from exc
    return at_boundary(backend, config, placed, device)


def _load(spec: ModelVersionSpec, artifact: Path, device: str) -> Backend:
    config = spec.config
    inputs = [t.name for t in config.inputs]
    outputs = [t.name for t in config.outputs]
    if config.backend == "torch_export":
        return TorchExportBackend(artifact, device, outputs)
    if config.backend == "torchscript":
        return TorchScriptBackend(
            artifact, device, inputs, outputs, config.batching.mask_input, freeze=config.freeze
        )
    from sluice_inference.worker.backends.onnx_runtime import OnnxRuntimeBackend

    return OnnxRuntimeBackend(artifact, device, config)
