"""The demo model repository, generated from code with fixed seeds (nothing is downloaded).

- `mlp`: 256→1024→1024→10 ReLU MLP; deterministic with the result cache on, so the demo shows hits.
- `encoder`: masked mean-pooling text encoder, variable sequence length; exercises buckets and padding;
  declares its token ids' range (the vocabulary), so an out-of-vocabulary id never reaches the forward.
- `synthetic`: SIMULATED GPU-like latency t(b) = 5 ms + 0.5 ms·b, deterministic output, for scheduling
  benchmarks; no real model behind it.
- `mlp_onnx`: the same MLP (same weights) as an ONNX graph served by ONNX Runtime, configured with a Triton
  `config.pbtxt` beside the others' `config.yaml`; written only when the `onnx` package is installed
  (the `onnx` extra), since a worker could not serve it without onnxruntime anyway.

Idempotent: running `init_demo_repository` twice writes byte-identical files (configs, and `.pt2` archives:
torch.export serialises deterministically given the same weights and archive name; we save through a
buffer so the archive's internal folder name never depends on the destination path). Files are replaced
atomically, so a worker scanning concurrently sees the old or the new file, never half of one.

Export notes: a dynamic dim is exported from an example of size 2, because an example of size 1 makes
torch.export specialise the dim to the constant 1 (the 0/1 specialisation) and fail. Inputs are passed as
keyword arguments so the program is called by config input name.
"""

from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from sluice_inference.worker.model_config import ModelConfig

MLP_SEED = 1234
ENCODER_SEED = 5678
ENCODER_VOCAB = 1000
ENCODER_DIM = 64
ENCODER_BUCKETS = (16, 32, 64, 128)

MLP_CONFIG: dict[str, Any] = {
    "name": "mlp",
    "description": "Demo MLP 256-1024-1024-10 (ReLU), fixed seed; deterministic, result cache on.",
    "backend": "torch_export",
    "inputs": [{"name": "input", "datatype": "FP32", "dims": [256]}],
    "outputs": [{"name": "output", "datatype": "FP32", "dims": [10]}],
    "max_batch_size": 64,
    "deterministic": True,
    "cache": "enabled",
    "batching": {"max_wait_ms": 2.0},
}
ENCODER_CONFIG: dict[str, Any] = {
    "name": "encoder",
    "description": "Demo masked mean-pooling text encoder (vocab 1000, dim 64), fixed seed.",
    "backend": "torch_export",
    # Token ids index the embedding table: the range keeps the rest out of the forward (on CUDA an
    # out-of-range index is a sticky device-side assert).
    "inputs": [{"name": "tokens", "datatype": "INT64", "dims": [-1], "range": [0, ENCODER_VOCAB - 1]}],
    "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [ENCODER_DIM]}],
    "max_batch_size": 32,
    "deterministic": True,
    "batching": {
        "max_wait_ms": 2.0,
        "buckets": {"tokens": list(ENCODER_BUCKETS)},
        "pad_value": 0,
        "mask_input": "mask",
    },
}
SYNTHETIC_CONFIG: dict[str, Any] = {
    "name": "synthetic",
    "description": "SIMULATED GPU latency profile t(b) = 5 ms + 0.5 ms * b; sleeps, output y = 2x + 1.",
    "backend": "synthetic",
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [16]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [16]}],
    "max_batch_size": 32,
    "deterministic": True,
    "batching": {"max_wait_ms": 2.0},
    "synthetic": {"base_ms": 5.0, "per_item_ms": 0.5},
}


MLP_ONNX_NAME = "mlp_onnx"
MLP_ONNX_CONFIG = f"""# Demo model {MLP_ONNX_NAME!r}, written by `sluice models init`: the demo MLP weights as
# an ONNX graph. A Triton config.pbtxt, served unchanged (docs/models.md); edits are overwritten.
name: "{MLP_ONNX_NAME}"
platform: "onnxruntime_onnx"
max_batch_size: {MLP_CONFIG["max_batch_size"]}
input [ {{ name: "input", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "output", data_type: TYPE_FP32, dims: [ 10 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
response_cache {{ enable: true }}
"""


class MaskedMeanEncoder(nn.Module):
    """Token embedding → linear → tanh, then the mean over positions where `mask` is 1.

    A padded position contributes exactly zero to the sum and nothing to the count, so a row's output does
    not depend on what lies beyond its length (up to float summation order).
    """

    def __init__(self, vocab: int = ENCODER_VOCAB, dim: int = ENCODER_DIM) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.project = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens INT64 [B, L], mask FP32 [B, L] → embedding FP32 [B, dim]."""
        hidden = torch.tanh(self.project(self.embedding(tokens)))
        weights = mask.unsqueeze(-1)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def build_mlp() -> nn.Sequential:
    """The demo MLP with its fixed-seed weights, in eval mode."""
    torch.manual_seed(MLP_SEED)
    layers = [nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)]
    return nn.Sequential(*layers).eval()


def build_encoder() -> MaskedMeanEncoder:
    """The demo encoder with its fixed-seed weights, in eval mode."""
    torch.manual_seed(ENCODER_SEED)
    return MaskedMeanEncoder().eval()


def export_mlp(max_batch_size: int) -> torch.export.ExportedProgram:
    """torch.export the MLP with a dynamic batch dim 1..max_batch_size."""
    batch = torch.export.Dim("batch", min=1, max=max_batch_size)
    example = {"input": torch.zeros(2, 256)}
    return torch.export.export(build_mlp(), (), kwargs=example, dynamic_shapes={"input": {0: batch}})


def export_encoder(max_batch_size: int, max_length: int) -> torch.export.ExportedProgram:
    """torch.export the encoder with dynamic batch (1..max_batch_size) and length (1..max_length) dims."""
    batch = torch.export.Dim("batch", min=1, max=max_batch_size)
    length = torch.export.Dim("length", min=1, max=max_length)
    example = {"tokens": torch.zeros(2, 8, dtype=torch.int64), "mask": torch.ones(2, 8)}
    shapes = {"tokens": {0: batch, 1: length}, "mask": {0: batch, 1: length}}
    return torch.export.export(build_encoder(), (), kwargs=example, dynamic_shapes=shapes)


def init_demo_repository(root: Path) -> list[Path]:
    """Write the demo models under `root` (created if needed); returns their model folders (`mlp_onnx`
    only when the `onnx` package is installed: see `onnx_demo_available`)."""
    folders = []
    for config in (MLP_CONFIG, ENCODER_CONFIG, SYNTHETIC_CONFIG):
        parsed = ModelConfig.model_validate(config)  # a typo here should fail now, not at worker start
        folder = root / parsed.name
        (folder / "1").mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / "config.yaml", _config_yaml(config))
        program = _export(parsed)
        if program is not None:
            buffer = io.BytesIO()
            torch.export.save(program, buffer)
            _write_atomic(folder / "1" / "model.pt2", buffer.getvalue())
        folders.append(folder)
    if onnx_demo_available():
        folders.append(_write_mlp_onnx(root))
    return folders


def onnx_demo_available() -> bool:
    """Whether `mlp_onnx` can be written here (the `onnx` package builds it)."""
    return importlib.util.find_spec("onnx") is not None


def _write_mlp_onnx(root: Path) -> Path:
    from sluice_inference.worker.demo_onnx import mlp_onnx_bytes

    folder = root / MLP_ONNX_NAME
    (folder / "1").mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / "config.pbtxt", MLP_ONNX_CONFIG.encode())
    _write_atomic(folder / "1" / "model.onnx", mlp_onnx_bytes(build_mlp()))
    return folder


def _export(config: ModelConfig) -> torch.export.ExportedProgram | None:
    if config.name == "mlp":
        return export_mlp(config.max_batch_size)
    if config.name == "encoder":
        return export_encoder(config.max_batch_size, config.batching.buckets["tokens"][-1])
    return None


def _config_yaml(config: dict[str, Any]) -> bytes:
    header = (
        f"# Demo model {config['name']!r}, generated by `sluice models init` (fixed seeds); edits are "
        "overwritten.\n"
    )
    if config["backend"] == "synthetic":
        header += "# SIMULATED: no real model; the worker sleeps a GPU-like latency profile.\n"
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100)
    return (header + body).encode()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
