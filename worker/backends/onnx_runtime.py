"""Backend for ONNX models (`model.onnx`) through ONNX Runtime, Triton's `onnxruntime_onnx` platform.

Binding is by name, as in Triton's ONNX Runtime backend: each declared input (and the mask input, when the
model takes one) must be a graph input, each declared output a graph output, with the same element type
and a batch dim that can hold `max_batch_size` rows; otherwise the model is refused at load, naming the
graph's real inputs and outputs. Execution providers (`providers`): CUDA when the model's device is CUDA
and `onnxruntime-gpu` provides it; without it, a `device: gpu` model (Triton's KIND_GPU) is refused, while
an `auto` one runs on the CPU provider, with a warning, as Triton's KIND_AUTO falls back to the CPU (the
answers are the same; only speed differs). The session gets the same
intra-op thread budget as torch on this worker (`torch.get_num_threads()`, set by the executor) and runs
its operators sequentially, so one worker does not spread over cores its neighbours use.

Tensors cross as numpy arrays (zero-copy on the CPU; on CUDA through host memory, which the CUDA provider
copies to the device): the executor's contract is torch tensors in and out (backends/base.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from sluice_inference.worker.model_config import DeviceKind, ModelConfig

log = logging.getLogger(__name__)

# Protocol datatype → ONNX Runtime's type string.
_ORT_TYPES = {
    "BOOL": "tensor(bool)",
    "UINT8": "tensor(uint8)",
    "UINT16": "tensor(uint16)",
    "UINT32": "tensor(uint32)",
    "UINT64": "tensor(uint64)",
    "INT8": "tensor(int8)",
    "INT16": "tensor(int16)",
    "INT32": "tensor(int32)",
    "INT64": "tensor(int64)",
    "FP16": "tensor(float16)",
    "FP32": "tensor(float)",
    "FP64": "tensor(double)",
}


class GraphMismatch(ValueError):
    """The config does not fit the ONNX graph (names the graph's real inputs and outputs)."""


class OnnxRuntimeBackend:
    """An ONNX Runtime inference session on one device."""

    name = "onnxruntime"

    def __init__(self, artifact: Path, device: str, config: ModelConfig) -> None:
        import onnxruntime as ort  # the `onnx` extra: only workers serving ONNX models need it

        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        chosen = providers(ort.get_available_providers(), device, config.device)
        if chosen == ["CPUExecutionProvider"] and torch.device(device).type == "cuda":
            log.warning(
                "model %s: onnxruntime has no CUDA provider here (install onnxruntime-gpu): on the CPU",
                config.name,
            )
        self._session = ort.InferenceSession(str(artifact), options, providers=chosen)
        graph_inputs = {i.name: i for i in self._session.get_inputs()}
        graph_outputs = {o.name: o for o in self._session.get_outputs()}
        self.signature = "inputs {} -> outputs {}".format(
            ", ".join(_describe(i) for i in graph_inputs.values()),
            ", ".join(_describe(o) for o in graph_outputs.values()),
        )
        mask = config.batching.mask_input
        wanted_inputs = [(t.name, t.datatype) for t in config.inputs] + ([(mask, "FP32")] if mask else [])
        self._check("input", wanted_inputs, graph_inputs, config.max_batch_size)
        wanted_outputs = [(t.name, t.datatype) for t in config.outputs]
        self._check("output", wanted_outputs, graph_outputs, config.max_batch_size)
        self._output_names = [t.name for t in config.outputs]

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the session over one batch."""
        feeds = {name: tensor.detach().cpu().numpy() for name, tensor in inputs.items()}
        results = self._session.run(self._output_names, feeds)
        return {name: torch.from_numpy(r) for name, r in zip(self._output_names, results, strict=True)}

    def _check(
        self, kind: str, wanted: Sequence[tuple[str, str]], graph: Mapping[str, Any], rows: int
    ) -> None:
        for name, datatype in wanted:
            found = graph.get(name)
            if found is None:
                raise GraphMismatch(f"{kind} {name!r} is not in the model's graph: {self.signature}")
            if found.type != _ORT_TYPES[datatype]:
                raise GraphMismatch(f"{kind} {name!r} is {datatype} in the config, {found.type} in the graph")
            batch = found.shape[0] if found.shape else None
            if isinstance(batch, int) and batch > 0 and batch < rows:
                raise GraphMismatch(
                    f"{kind} {name!r} has a fixed batch dim {batch} < max_batch_size {rows}: export it "
                    "with a dynamic first dim, or lower max_batch_size"
                )


def providers(available: Sequence[str], device: str, kind: DeviceKind) -> list[Any]:
    """ONNX Runtime providers for a model placed on `device` whose config asks for `kind`."""
    placed = torch.device(device)
    if placed.type == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in available:
        return [("CUDAExecutionProvider", {"device_id": placed.index or 0}), "CPUExecutionProvider"]
    if kind == "gpu":
        raise GraphMismatch(f"device {device}: install onnxruntime-gpu for ONNX models on CUDA (device: gpu)")
    return ["CPUExecutionProvider"]


def _describe(node: Any) -> str:
    dims = ", ".join(str(d) if d is not None else "?" for d in node.shape)
    return f"{node.name}: {node.type.removeprefix('tensor(').rstrip(')')}[{dims}]"
