"""Backends: what turns a batch of tensors into outputs for one model version on one device.

`torch_export` (`.pt2`) is the primary format, `torchscript` (`.pt`, deprecated by PyTorch) the second,
and `synthetic` a SIMULATED latency profile for scheduling benchmarks. `load_backend` is the only
constructor callers use; a loading failure raises RepositoryError naming the artifact.
"""

from __future__ import annotations

from pathlib import Path

from worker.backends.base import Backend
from worker.backends.synthetic import SyntheticBackend
from worker.backends.torch_export import TorchExportBackend
from worker.backends.torchscript import TorchScriptBackend
from worker.repository import ModelVersionSpec, RepositoryError

__all__ = ["Backend", "load_backend"]


def load_backend(spec: ModelVersionSpec, device: str, synthetic_slowdown: float = 1.0) -> Backend:
    """Load `spec`'s artifact onto `device` with the backend its config names."""
    config = spec.config
    output_names = [t.name for t in config.outputs]
    if config.backend == "synthetic":
        return SyntheticBackend(config, device, synthetic_slowdown)
    if spec.artifact is None:
        message = f"backend {config.backend} needs an artifact"
        raise RepositoryError(message, path=Path(spec.name, spec.version))
    try:
        if config.backend == "torch_export":
            return TorchExportBackend(spec.artifact, device, output_names)
        return TorchScriptBackend(spec.artifact, device, output_names)
    except Exception as exc:
        # torch raises many unrelated types for a corrupt or incompatible file (BadZipFile, RuntimeError,
        # pickle errors...); all of them mean the same to the operator: this artifact cannot be served.
        raise RepositoryError(f"cannot load with {config.backend}: {exc}", path=spec.artifact) from exc
