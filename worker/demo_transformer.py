"""A transformer-sized demo model for GPUs, made from a config with fixed-seed random weights (nothing is
downloaded): a BERT-base-shaped encoder, `sluice models init --gpu`.

The small demos (worker/demo_models.py) cost too little for batching to matter on a GPU: a forward of the
MLP is launch overhead at any batch size. This one costs what a real text encoder costs, so a GPU run
shows what batching buys. Written with plain torch.nn (no model library) and saved as TorchScript
(`model.pt`, backend `torchscript`): one artifact takes any batch and sequence length, and loads with
`map_location` on the worker's device.

Shape: INT64 token ids [B, L] (L variable, bucketed) and the worker's FP32 padding mask [B, L] →
pooled FP32 [B, hidden] (BERT's pooler: the first position through dense + tanh). Padded positions are
masked out of attention, so a row's output does not depend on its padding beyond float summation order.

Models written (one artifact each, same weights):
- `bert`: FP32, on the worker's device;
- `bert_fp16`, `bert_bf16`: the weights and activations in half precision, the output cast back to FP32
  (clients see the same datatype); `device: gpu` under `sluice models init --gpu` (half precision is
  what a GPU serves; a CPU worker refuses them), any device when the GPU kit rehearses on a CPU;
- `bert_b1` (GPU kit only): `bert` with max_batch_size 1, batching off for comparison;
- `bert_oom` (GPU kit only): `bert` with one bucket at `max_positions` (4x the longest) and warm-up at
  batch 1 only, so a full batch needs more device memory than warm-up reserved (the kit's out-of-memory
  check).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice_inference.worker.demo_models import _config_yaml, _write_atomic
from sluice_inference.worker.model_config import ModelConfig

SEED = 2468


@dataclass(frozen=True)
class EncoderShape:
    """The encoder's size, its batching buckets and the largest batch a forward takes."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    buckets: tuple[int, ...]
    max_batch_size: int
    max_positions: int
    """Positions the artifact has embeddings for: the longest sequence any of its models accepts (the
    buckets stop below it; `bert_oom` uses all of it)."""
    max_wait_ms: float = 2.0


BERT_BASE = EncoderShape(
    layers=12,
    hidden=768,
    heads=12,
    vocab=30522,
    buckets=(16, 32, 64, 128),
    max_batch_size=64,
    max_positions=512,
)
"""BERT-base: 12 layers, hidden 768, 12 heads, BERT's vocabulary size; 64 rows of 128 tokens is about
1.5 GB of activations in FP32, far inside any data-centre GPU."""
TINY = EncoderShape(
    layers=2, hidden=64, heads=4, vocab=1000, buckets=(8, 16, 32), max_batch_size=16, max_positions=128
)
"""For the CPU rehearsal and the tests: the same code in milliseconds per forward."""

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class EncoderLayer(nn.Module):
    """Post-norm transformer layer as in BERT: self-attention, then a GELU feed-forward 4x wide."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden, eps=1e-12)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x [B, L, H]; keep bool [B, 1, 1, L], True on real positions."""
        batch, length, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, hidden // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep
        )
        x = self.norm1(x + self.out(attended.transpose(1, 2).reshape(batch, length, hidden)))
        out: torch.Tensor = self.norm2(x + self.down(F.gelu(self.up(x))))
        return out


class PooledEncoder(nn.Module):
    """Token + position embeddings, `layers` encoder layers, BERT's pooler; output FP32 whatever the
    weights' dtype."""

    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.positions = nn.Embedding(shape.max_positions, shape.hidden)
        self.norm = nn.LayerNorm(shape.hidden, eps=1e-12)
        self.layers = nn.ModuleList([EncoderLayer(shape.hidden, shape.heads) for _ in range(shape.layers)])
        self.pool = nn.Linear(shape.hidden, shape.hidden)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens INT64 [B, L], mask FP32 [B, L] (1 real, 0 padding) → pooled FP32 [B, hidden]."""
        where = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.norm(self.tokens(tokens) + self.positions(where))
        keep = (mask > 0.5)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keep)
        return torch.tanh(self.pool(x[:, 0])).float()


def build_encoder(shape: EncoderShape, dtype: str = "fp32") -> PooledEncoder:
    """The encoder with its fixed-seed weights (the same for every dtype), in eval mode."""
    torch.manual_seed(SEED)
    model = PooledEncoder(shape)
    for name, weight in model.named_parameters():
        # BERT's initialisation (normal, std 0.02) keeps activations in half precision's range.
        if weight.dim() > 1:
            nn.init.normal_(weight, std=0.02)
        elif "norm" not in name:
            nn.init.zeros_(weight)
    return model.to(DTYPES[dtype]).eval()


def scripted_bytes(shape: EncoderShape, dtype: str = "fp32") -> bytes:
    """The TorchScript artifact (`model.pt`) of `build_encoder(shape, dtype)`."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # Deprecated by PyTorch, chosen anyway: what Triton's pytorch_libtorch serves (module docstring).
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(build_encoder(shape, dtype)), buffer)
    return buffer.getvalue()


def encoder_config(name: str, shape: EncoderShape, dtype: str = "fp32", **overrides: Any) -> dict[str, Any]:
    """The config.yaml of one encoder model; `overrides` replace top-level keys (`device`, `max_batch_size`,
    `batching`, `warmup_batch_sizes`)."""
    config: dict[str, Any] = {
        "name": name,
        "description": (
            f"Demo transformer encoder ({shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, "
            f"{dtype}), fixed-seed random weights: a cost like BERT-base's, not a trained model."
        ),
        "backend": "torchscript",
        "inputs": [{"name": "tokens", "datatype": "INT64", "dims": [-1], "range": [0, shape.vocab - 1]}],
        "outputs": [{"name": "pooled", "datatype": "FP32", "dims": [shape.hidden]}],
        "max_batch_size": shape.max_batch_size,
        "batching": {
            "max_wait_ms": shape.max_wait_ms,
            "buckets": {"tokens": list(shape.buckets)},
            "pad_value": 0,
            "mask_input": "mask",
        },
    }
    config.update(overrides)
    return config


def write_encoder(root: Path, config: dict[str, Any], artifact: bytes) -> Path:
    """Write one model folder (config.yaml and 1/model.pt) under `root`, atomically per file."""
    parsed = ModelConfig.model_validate(config)  # a mistake here should fail now, not at worker start
    folder = root / parsed.name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / "config.yaml", _config_yaml(config))
    _write_atomic(folder / "1" / "model.pt", artifact)
    return folder


def init_gpu_repository(root: Path, shape: EncoderShape = BERT_BASE, half_device: str = "gpu") -> list[Path]:
    """`sluice models init --gpu`: `bert` (FP32) and its `bert_fp16` and `bert_bf16` variants, with
    `half_device` as the variants' `device` (gpu: only CUDA workers load them)."""
    folders = [write_encoder(root, encoder_config("bert", shape), scripted_bytes(shape))]
    for dtype in ("fp16", "bf16"):
        config = encoder_config(f"bert_{dtype}", shape, dtype, device=half_device)
        folders.append(write_encoder(root, config, scripted_bytes(shape, dtype)))
    return folders
