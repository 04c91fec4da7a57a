"""What a worker publishes about itself in etcd (`workers/<id>`), and what routers read back.

The router never opens model files: everything it needs to validate requests, answer ModelMetadata and
batch (tensor specs, max batch size, max wait) travels in these records. JSON on the wire; unknown fields
are ignored so older routers read newer workers' records.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

WorkerStateName = Literal["starting", "ready", "draining"]


class TensorSpec(BaseModel):
    """One model input or output: name, protocol datatype, dims without the batch dim (-1 = variable)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    datatype: str
    dims: tuple[int, ...]
    range: tuple[int, int] | None = None
    """Inclusive bounds every element must lie in (integer inputs, e.g. token ids); None: any value."""


class ModelRecord(BaseModel):
    """One loaded, warmed model version on a worker."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    version: str
    digest: str = Field(description="sha256 over config and artifact bytes")
    platform: str = Field(description="backend name, e.g. torch_export")
    max_batch_size: int = Field(ge=1)
    max_wait_s: float = Field(ge=0, description="longest a queued request waits for a fuller batch")
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    deterministic: bool = Field(default=False, description="same inputs always give the same outputs")
    cache: bool = Field(default=False, description="results may be cached (only if deterministic)")
    cache_scope: Literal["tenant", "shared"] = Field(default="tenant", description="who may share entries")
    buckets: dict[str, tuple[int, ...]] = Field(
        default_factory=dict, description="per input with a variable dim: the sizes it is padded up to"
    )
    max_batch_cost: int | None = Field(default=None, description="cap on a batch's padded elements")
    warmup_s: dict[int, float] = Field(
        default_factory=dict, description="forward time by batch size measured at warm-up (seeds estimates)"
    )


class WorkerRecord(BaseModel):
    """The value under `workers/<worker_id>`, bound to the worker's lease."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    worker_id: str
    addr: str = Field(description="host:port of the worker's gRPC server")
    device: str
    models: tuple[ModelRecord, ...]
    capacity: int = Field(
        ge=1, description="batches the worker holds at once across all routers (more: refused worker_busy)"
    )
    state: WorkerStateName
    started_at: float = Field(description="unix time the process started")

    def to_json(self) -> bytes:
        """Serialise for etcd."""
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, raw: bytes) -> WorkerRecord:
        """Parse an etcd value (raises pydantic.ValidationError on garbage)."""
        return cls.model_validate_json(raw)
