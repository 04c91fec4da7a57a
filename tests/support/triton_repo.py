"""A Triton-format model repository written by tests, as a Triton user would bring it (no config.yaml):

- `peer_mlp`: a TorchScript MLP whose forward is `forward(self, x)`, served as Triton names it
  (`INPUT__0` → `OUTPUT__0`, bound by position), versions 1 and 2 (different weights), both served
  (`version_policy: specific`), with `dynamic_batching`, and two Triton settings Sluice does not apply
  (instance count 2, a backend parameter) that its load warning must name;
- `onnx_mlp`: an ONNX MLP (`onnxruntime_onnx`), versions 1..3 of which `latest { num_versions: 1 }` serves
  only 3, with `dynamic_batching` and the response cache on;
- `toy`: a Sluice `config.yaml` model (synthetic) beside them.

Small widths (16 → 32 → 4) keep the artifacts tiny and warm-up instant. `reference` computes what each
artifact answers in-process (TorchScript or ONNX Runtime, one thread), for comparing with what the cluster
answers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from sluice_inference.worker.backends.torchscript import for_inference
from sluice_inference.worker.demo_onnx import mlp_onnx_bytes

WIDTH_IN, HIDDEN, WIDTH_OUT = 16, 32, 4
MAX_BATCH = 8

PEER_MLP_PBTXT = f"""
name: "peer_mlp"
platform: "pytorch_libtorch"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ {WIDTH_IN} ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {WIDTH_OUT} ] }} ]
version_policy: {{ specific: {{ versions: [ 1, 2 ] }} }}
dynamic_batching {{
  max_queue_delay_microseconds: 500
  preferred_batch_size: [ 4 ]
}}
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
parameters: {{ key: "INFERENCE_MODE" value: {{ string_value: "true" }} }}
"""
ONNX_MLP_PBTXT = f"""
name: "onnx_mlp"
backend: "onnxruntime"
max_batch_size: {MAX_BATCH}
input [ {{ name: "input" data_type: TYPE_FP32 dims: [ {WIDTH_IN} ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ {WIDTH_OUT} ] }} ]
version_policy: {{ latest: {{ num_versions: 1 }} }}
dynamic_batching {{ max_queue_delay_microseconds: 1000 }}
response_cache {{ enable: true }}
"""
TOY_YAML = {
    "name": "toy",
    "backend": "synthetic",
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [4]}],
    "max_batch_size": 8,
    "synthetic": {"base_ms": 0, "per_item_ms": 0},
}


class PeerMLP(nn.Module):
    """What a peer team exports: a plain module whose forward takes `x`."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(nn.Linear(WIDTH_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH_OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x FP32 [B, 16] → FP32 [B, 4]."""
        result: torch.Tensor = self.layers(x)
        return result


def small_mlp(seed: int) -> nn.Sequential:
    """A small Linear/ReLU MLP with fixed-seed weights, in eval mode."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH_OUT)).eval()


def write_triton_repository(root: Path) -> Path:
    """Write the three models under `root` (created); returns `root`."""
    peer = root / "peer_mlp"
    for version in (1, 2):
        (peer / str(version)).mkdir(parents=True)
        traced = torch.jit.trace(PeerMLP(seed=version).eval(), torch.zeros(2, WIDTH_IN))  # type: ignore[no-untyped-call]
        torch.jit.save(traced, str(peer / str(version) / "model.pt"))
    (peer / "config.pbtxt").write_text(PEER_MLP_PBTXT)
    onnx_model = root / "onnx_mlp"
    for version in (1, 2, 3):
        (onnx_model / str(version)).mkdir(parents=True)
        (onnx_model / str(version) / "model.onnx").write_bytes(mlp_onnx_bytes(small_mlp(seed=10 + version)))
    (onnx_model / "config.pbtxt").write_text(ONNX_MLP_PBTXT)
    toy = root / "toy"
    (toy / "1").mkdir(parents=True)
    (toy / "config.yaml").write_text(yaml.safe_dump(TOY_YAML, sort_keys=False))
    return root


def reference(root: Path, model: str, version: int, x: np.ndarray) -> np.ndarray:
    """What the artifact answers for `x` (one batch) run in-process outside Sluice, on one thread, the way
    its backend runs it by default: ONNX Runtime's default graph optimizations, a TorchScript module frozen
    for inference (docs/models.md)."""
    torch.set_num_threads(1)
    artifact = root / model / str(version)
    if model == "onnx_mlp":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(
            str(artifact / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        result: np.ndarray = session.run(None, {"input": x})[0]
        return result
    loaded = torch.jit.load(str(artifact / "model.pt")).eval()  # type: ignore[no-untyped-call]
    module = for_inference(loaded, artifact / "model.pt")
    with torch.inference_mode():
        answer: np.ndarray = module(torch.from_numpy(x)).numpy()
    return answer
