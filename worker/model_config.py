"""The typed form of `models/<name>/config.yaml` (DESIGN §7), and of a Triton `config.pbtxt` once
worker/triton_config.py has translated it: both formats are served from this one model.

Rules: unknown keys are errors (a typo must not silently fall back to a default); every rule that spans
fields lives here, so a config that loads is one the repository, backends and executor can use without
re-checking; every error names the file and the offending key (`ModelConfigError`). Tensor dims never
include the batch dimension; -1 marks a variable dim.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from sluice_inference.common.batching import BatchLimits
from sluice_inference.common.buckets import row_cost
from sluice_inference.common.tensors import DATATYPES

INTEGER_DATATYPES = frozenset({"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"})
"""The datatypes a `range` may be declared for."""

BackendName = Literal["torch_export", "torchscript", "onnxruntime", "synthetic"]
DeviceKind = Literal["auto", "cpu", "gpu"]

# Names end up in etcd keys, cache keys and metric labels: keep them to a filesystem- and URL-safe set.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ModelConfigError(ValueError):
    """The model repository on disk cannot be used; names the file (and the key, when there is one)."""

    def __init__(self, message: str, *, path: Path, key: str = "") -> None:
        where = f"{path}: {key}: " if key else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.key = key


def _key_error(key: str, message: str) -> PydanticCustomError:
    """A cross-field error that keeps the key it concerns (model validators otherwise lose the location)."""
    return PydanticCustomError("sluice_key", "{message}", {"key": key, "message": message})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TensorConfig(_Strict):
    """One input or output of the model as clients see it."""

    name: str = Field(min_length=1)
    """Tensor name. TorchScript: `<any>__<i>` names (Triton's `INPUT__0`, `OUTPUT__0`) bind by position i,
    other names by keyword; ONNX: the graph's input/output name (worker/backends/)."""
    datatype: str
    """Protocol datatype (FP32, INT64, ...; see sluice_inference.common.tensors.DATATYPES)."""
    dims: tuple[int, ...]
    """Per-row shape WITHOUT the batch dimension; -1 marks a variable dim."""
    range: tuple[int, int] | None = None
    """Inputs of an integer datatype only: inclusive bounds `[lo, hi]` every element must lie in (token
    ids: `[0, vocab - 1]`). Values outside are the client's mistake (INVALID_ARGUMENT), caught before the
    forward: on CUDA an out-of-range embedding index is a sticky device-side assert that breaks the device
    for every later batch. Published in the worker's registration so routers check it first."""
    reshape: tuple[int, ...] | None = None
    """The per-row shape the model itself takes or returns when it differs from `dims` (Triton's
    `reshape`): the worker reshapes each batch between the two. At most one -1 on each side, and with
    fixed dims both sides must hold the same number of elements."""

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, value: str) -> str:
        if value not in DATATYPES:
            raise ValueError(f"unknown datatype {value!r} (one of {', '.join(DATATYPES)})")
        return value

    @field_validator("dims")
    @classmethod
    def _dims_positive_or_variable(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(d != -1 and d < 1 for d in value):
            raise ValueError(f"dims {list(value)}: each dim is -1 (variable) or >= 1")
        return value

    @model_validator(mode="after")
    def _range_fits_datatype(self) -> TensorConfig:
        if self.range is None:
            return self
        lo, hi = self.range
        if self.datatype not in INTEGER_DATATYPES:
            raise _key_error("range", f"only integer datatypes take a range, not {self.datatype}")
        if lo > hi:
            raise _key_error("range", f"[{lo}, {hi}]: lo must be <= hi")
        info = np.iinfo(DATATYPES[self.datatype])
        if lo < info.min or hi > info.max:
            raise _key_error("range", f"[{lo}, {hi}] exceeds {self.datatype} ({info.min}..{info.max})")
        return self

    @model_validator(mode="after")
    def _reshape_compatible(self) -> TensorConfig:
        if self.reshape is None:
            return self
        if any(d != -1 and d < 1 for d in self.reshape):
            raise _key_error("reshape", f"{list(self.reshape)}: each dim is -1 (variable) or >= 1")
        if self.dims.count(-1) > 1 or self.reshape.count(-1) > 1:
            raise _key_error("reshape", "supported only with at most one variable (-1) dim on each side")
        if (-1 in self.dims) != (-1 in self.reshape):
            raise _key_error(
                "reshape", f"{list(self.reshape)} and dims {list(self.dims)}: both or neither variable"
            )
        if -1 not in self.dims and math.prod(self.dims) != math.prod(self.reshape):
            message = f"{list(self.reshape)} holds {math.prod(self.reshape)} elements, dims {list(self.dims)}"
            raise _key_error("reshape", f"{message} hold {math.prod(self.dims)}")
        return self

    @property
    def is_variable(self) -> bool:
        """Whether any dim is variable."""
        return -1 in self.dims


class BatchingConfig(_Strict):
    """How requests for this model are combined into batches."""

    max_wait_ms: float = Field(default=2.0, ge=0)
    """Longest a queued request waits for a fuller batch while the pipeline behind the batcher is free, in
    milliseconds (Triton's `max_queue_delay_microseconds`). A busy worker, or a router whose own CPU is
    saturated, holds batches longer (up to `router.pressure_hold_factor` times this: docs/batching.md); 0
    never waits for more."""
    buckets: dict[str, tuple[int, ...]] = Field(default_factory=dict)
    """Per variable-dim input: the padded lengths batches are formed at (strictly increasing); the largest
    bucket is also the longest length the model accepts."""
    pad_value: int | float = 0
    """Value written into padded positions of bucketed inputs."""
    mask_input: str | None = None
    """Name of a backend-only input (not declared in `inputs`) that the worker fills with an FP32 [rows, L]
    mask: 1 for real positions, 0 for padding; L is the variable dim of the one variable-dim input."""
    max_batch_cost: int | None = Field(default=None, ge=1)
    """Upper bound on a batch's cost (rows x padded length for bucketed inputs); none when unset."""

    @field_validator("buckets")
    @classmethod
    def _buckets_increasing(cls, value: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        for name, sizes in value.items():
            if not sizes or sizes[0] < 1 or any(a >= b for a, b in itertools.pairwise(sizes)):
                raise ValueError(f"{name}: {list(sizes)} must be non-empty, >= 1 and strictly increasing")
        return value


class VersionPolicy(_Strict):
    """Which numeric version folders to load: exactly one of `latest`, `all`, `specific`."""

    latest: int | None = Field(default=None, ge=1)
    """Load the N highest versions."""
    all: Literal[True] | None = None
    """Load every version present."""
    specific: tuple[int, ...] | None = None
    """Load exactly these versions; each must exist."""

    @model_validator(mode="after")
    def _exactly_one(self) -> VersionPolicy:
        chosen = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError("give exactly one of latest: N, all: true, specific: [versions]")
        if self.specific is not None and (not self.specific or min(self.specific) < 1):
            raise _key_error("specific", "needs at least one version, each a positive integer")
        return self

    def select(self, available: list[int]) -> list[int]:
        """The versions to load out of `available`, ascending; ValueError names any missing `specific` one."""
        present = sorted(set(available))
        if self.latest is not None:
            return present[-self.latest :]
        if self.specific is not None:
            missing = sorted(set(self.specific) - set(present))
            if missing:
                raise ValueError(f"version_policy.specific: versions {missing} have no folder")
            return sorted(set(self.specific))
        return present


class SyntheticConfig(_Strict):
    """SIMULATED latency profile t(b) = base_ms + per_item_ms * b; the synthetic backend sleeps that long."""

    base_ms: float = Field(ge=0)
    """Fixed cost of one forward pass, in milliseconds (simulated)."""
    per_item_ms: float = Field(ge=0)
    """Added cost per row of the batch, in milliseconds (simulated)."""
    per_token_ms: float = Field(default=0.0, ge=0)
    """Added cost per row and per element of a variable-length input (after padding), in milliseconds:
    long inputs cost more, as with a sequence model (simulated)."""
    fault_trigger: float | None = None
    """TEST/DEMO ONLY, a SIMULATED device fault: a forward whose first input starts a row with this value
    raises what a CUDA device-side assert raises, and so does every later forward (a real CUDA context
    stays broken), so the worker's device-fault exit can be exercised on a CPU. Unset: never."""
    hang_trigger: float | None = None
    """TEST/DEMO ONLY, a SIMULATED hung device: a forward whose first input starts a row with this value
    sleeps `hang_s` before it returns, while the worker's event loop (and its heartbeats) carry on, so
    routers' detection of a forward pass that never ends can be exercised. Unset: never."""
    hang_s: float = Field(default=3600.0, gt=0)
    """How long a forward with `hang_trigger` sleeps (simulated)."""


class ModelConfig(_Strict):
    """`models/<name>/config.yaml` (or a translated config.pbtxt): what a model takes and returns, and how
    it is batched and served."""

    name: str
    """Model name; must equal the folder name."""
    description: str = ""
    """Free text for humans (ModelMetadata, dashboards)."""
    backend: BackendName
    """torch_export (model.pt2), torchscript (model.pt, deprecated by PyTorch), onnxruntime (model.onnx)
    or synthetic (simulated)."""
    filename: str | None = None
    """The artifact's file name inside each version folder (Triton's `default_model_filename`); default:
    model.pt2, model.pt or model.onnx by backend."""
    device: DeviceKind = "auto"
    """Where the model runs (Triton's `instance_group.kind`): auto, the worker's device; cpu, always the
    CPU (also on a GPU worker); gpu, only on a worker whose device is CUDA (a CPU worker refuses it)."""
    inputs: tuple[TensorConfig, ...] = Field(min_length=1)
    """Inputs as clients send them (backend-only inputs such as the mask are not listed)."""
    outputs: tuple[TensorConfig, ...] = Field(min_length=1)
    """Outputs the model returns, in the order a tuple-returning module yields them."""
    max_batch_size: int = Field(ge=1)
    """Most rows in one forward pass (and in one request)."""
    deterministic: bool = False
    """Same inputs give the same bytes out; required for the result cache."""
    cache: Literal["enabled", "disabled"] = "disabled"
    """Whether the router may serve results from its cache."""
    cache_scope: Literal["tenant", "shared"] = "tenant"
    """tenant: cache entries are per tenant; shared: tenants share entries for identical requests."""
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    """Batching knobs."""
    version_policy: VersionPolicy = Field(default_factory=lambda: VersionPolicy(latest=1))
    """Which versions to load (default: the latest one)."""
    synthetic: SyntheticConfig | None = None
    """Simulated latency profile; required for the synthetic backend, forbidden otherwise."""
    warmup_batch_sizes: tuple[int, ...] | None = None
    """Batch sizes run once before the model is reported ready (default: 1 and max_batch_size)."""
    freeze: bool = True
    """torchscript only: run the module frozen for inference (`torch.jit.freeze`, then
    `torch.jit.optimize_for_inference`: weights become constants, linear layers get their weights
    transposed once instead of on every forward). A module torch cannot freeze is served as loaded (the
    worker logs why); false serves every module as loaded."""

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"{value!r}: use letters, digits, '_', '.', '-' (not first)")
        return value

    @field_validator("filename")
    @classmethod
    def _plain_filename(cls, value: str | None) -> str | None:
        if value is not None and (not _NAME.match(value) or value in (".", "..")):
            raise ValueError(f"{value!r}: a plain file name (letters, digits, '_', '.', '-')")
        return value

    @field_validator("inputs", "outputs")
    @classmethod
    def _unique_names(cls, value: tuple[TensorConfig, ...]) -> tuple[TensorConfig, ...]:
        names = [t.name for t in value]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor names must be unique, got {names}")
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> ModelConfig:
        if (self.backend == "synthetic") != (self.synthetic is not None):
            raise _key_error("synthetic", "required when backend is synthetic, forbidden otherwise")
        if self.backend == "synthetic" and self.filename is not None:
            raise _key_error("filename", "a synthetic model has no artifact")
        if self.backend == "synthetic" and any(t.is_variable for t in self.outputs):
            raise _key_error("outputs", "the synthetic backend needs fixed output dims (no -1)")
        if self.cache == "enabled" and not self.deterministic:
            raise _key_error("cache", "enabled requires deterministic: true")
        self._check_batching()
        self._check_ranges()
        for size in self.warmup_batch_sizes or ():
            if not 1 <= size <= self.max_batch_size:
                raise _key_error("warmup_batch_sizes", f"{size} is outside 1..max_batch_size")
        return self

    def _check_batching(self) -> None:
        by_name = {t.name: t for t in self.inputs}
        for name in self.batching.buckets:
            if name not in by_name or not by_name[name].is_variable:
                raise _key_error("batching.buckets", f"{name!r} is not an input with a variable dim")
            if by_name[name].reshape is not None:
                raise _key_error("batching.buckets", f"{name!r} has a reshape: bucketed inputs cannot")
        mask = self.batching.mask_input
        if mask is not None:
            if mask in by_name:
                raise _key_error("batching.mask_input", f"{mask!r} is backend-only: do not list it in inputs")
            variable = [t for t in self.inputs if t.is_variable]
            if len(variable) != 1 or variable[0].dims.count(-1) != 1:
                raise _key_error("batching.mask_input", "needs exactly one input with one variable dim")

    def _check_ranges(self) -> None:
        for index, output in enumerate(self.outputs):
            if output.range is not None:
                raise _key_error(f"outputs.{index}.range", "a range applies to inputs only")
        pad = self.batching.pad_value
        for index, tensor in enumerate(self.inputs):
            if tensor.range is None or tensor.name not in self.batching.buckets:
                continue
            # Padding writes pad_value into the batch the model sees: outside the range it would be the
            # very value the range keeps away from the device.
            lo, hi = tensor.range
            if not lo <= pad <= hi:
                raise _key_error("batching.pad_value", f"{pad} is outside inputs.{index}.range [{lo}, {hi}]")

    @property
    def warmup_sizes(self) -> tuple[int, ...]:
        """The batch sizes to warm up with: `warmup_batch_sizes`, or (1, max_batch_size)."""
        if self.warmup_batch_sizes:
            return self.warmup_batch_sizes
        return tuple(sorted({1, self.max_batch_size}))

    @cached_property
    def batch_limits(self) -> BatchLimits:
        """What one forward of this model may hold, as the batching rule takes it (common/batching.py):
        max_batch_size rows and max_batch_cost."""
        return BatchLimits(self.max_batch_size, self.batching.max_batch_cost)

    def row_cost_of(self, shape: Sequence[Sequence[int]]) -> int:
        """What one row of padded `shape` (a non-batch shape per input, in `inputs` order) costs against
        max_batch_cost (common/buckets.py `row_cost`, as routers count it)."""
        if self._fixed_row_cost is not None:
            return self._fixed_row_cost
        return row_cost((spec.dims, dims) for spec, dims in zip(self.inputs, shape, strict=True))

    @cached_property
    def _fixed_row_cost(self) -> int | None:
        """Every row's cost when no input has a variable dim (a cost counts only variable dims, so it is
        the same for every shape): worked out once instead of for every batch."""
        if any(spec.is_variable for spec in self.inputs):
            return None
        return row_cost((spec.dims, spec.dims) for spec in self.inputs)

    @property
    def masked_input(self) -> TensorConfig | None:
        """The input whose variable dim the mask covers, when the model takes a mask."""
        if self.batching.mask_input is None:
            return None
        return next(t for t in self.inputs if t.is_variable)

    @classmethod
    def from_yaml(cls, raw: bytes, *, source: Path) -> ModelConfig:
        """Parse config bytes read from `source` (a `models/<name>/config.yaml`), checking the folder name."""
        try:
            data: Any = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ModelConfigError(f"not valid YAML: {exc}", path=source) from None
        if not isinstance(data, dict):
            raise ModelConfigError("expected a mapping of keys at the top level", path=source)
        try:
            config = cls.model_validate(data)
        except ValidationError as exc:
            key, message = first_error(exc)
            raise ModelConfigError(message, path=source, key=key) from None
        folder = source.parent.name
        if config.name != folder:
            message = f"{config.name!r} must equal the folder name {folder!r}"
            raise ModelConfigError(message, path=source, key="name")
        return config

    @classmethod
    def load(cls, path: Path) -> ModelConfig:
        """Read and validate `path`; ModelConfigError names the file and key on any problem."""
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ModelConfigError(f"cannot read: {exc.strerror}", path=path) from None
        return cls.from_yaml(raw, source=path)


def first_error(exc: ValidationError) -> tuple[str, str]:
    """(dotted key, message) of the first validation error; the message mentions how many more there are."""
    errors = exc.errors()
    first = errors[0]
    loc = [str(p) for p in first["loc"]]
    ctx = first.get("ctx") or {}
    if first["type"] == "sluice_key":
        loc.append(str(ctx["key"]))
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ".".join(loc) or "(top level)", message + more
