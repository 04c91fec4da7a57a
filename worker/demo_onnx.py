"""The demo MLP as an ONNX graph, built from the torch module's own weights with the `onnx` package.

Why not `torch.onnx.export`: in torch 2.13 it needs `onnxscript` (and the dynamo exporter) on top of
`onnx`; the MLP is three Gemm and two Relu nodes, so writing the graph directly costs a few lines and
one small dependency. The graph computes exactly the module's function (Linear is `x @ W.T + b`, a Gemm
with transB=1), with a symbolic batch dim so any batch size runs; serialisation is deterministic for a
given set of weights, so `sluice models init` stays byte-reproducible.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

OPSET = 17
IR_VERSION = 8  # what ONNX Runtime 1.14 and later load; our graph uses nothing newer
BATCH = "batch"


def mlp_onnx_bytes(mlp: nn.Sequential, input_name: str = "input", output_name: str = "output") -> bytes:
    """The serialized ONNX model of `mlp` (a Sequential of Linear and ReLU layers)."""
    from onnx import TensorProto, helper, numpy_helper  # the `onnx` extra: only model writers need it

    nodes: list[Any] = []
    initializers: list[Any] = []
    current = input_name
    layers = list(mlp)
    for index, layer in enumerate(layers):
        last = index == len(layers) - 1
        produced = output_name if last else f"h{index}"
        if isinstance(layer, nn.Linear):
            weight, bias = f"w{index}", f"b{index}"
            initializers.append(
                numpy_helper.from_array(layer.weight.detach().numpy().astype(np.float32), weight)
            )
            initializers.append(numpy_helper.from_array(layer.bias.detach().numpy().astype(np.float32), bias))
            nodes.append(helper.make_node("Gemm", [current, weight, bias], [produced], transB=1))
        elif isinstance(layer, nn.ReLU):
            nodes.append(helper.make_node("Relu", [current], [produced]))
        else:
            raise TypeError(f"layer {index} is a {type(layer).__name__}: only Linear and ReLU are written")
        current = produced
    width_in = next(m for m in layers if isinstance(m, nn.Linear)).in_features
    width_out = next(m for m in reversed(layers) if isinstance(m, nn.Linear)).out_features
    graph = helper.make_graph(
        nodes,
        "sluice_demo_mlp",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [BATCH, width_in])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, [BATCH, width_out])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="sluice")
    model.ir_version = IR_VERSION
    data: bytes = model.SerializeToString(deterministic=True)
    return data
