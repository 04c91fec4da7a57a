"""A Triton model's `config.pbtxt`, read as a Sluice `ModelConfig` (docs/models.md has the field table).

The file is parsed by protobuf's text format against our copy of Triton's ModelConfig schema
(protos/sluice/triton/model_config.proto), so what Triton accepts parses the same way and a misspelt field
is an error naming its line. Then each field is translated, under three rules:
1. a field Sluice serves the same way is translated (name, platform/backend, max_batch_size, inputs and
   outputs with dims and simple reshapes, dynamic batching's queue delay, version policy, instance kind,
   default_model_filename, response_cache);
2. a field that would change what clients get back if ignored refuses the model (`ModelConfigError`):
   sequence batching, ensembles, ragged or optional inputs, shape tensors, decoupled transactions, string
   tensors, max_batch_size 0;
3. every other field that is set, or read only in part, is named in the model's one load warning
   (`TritonModel.warnings`), with where Sluice takes that decision instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from pydantic import ValidationError

from sluice_inference.common.pb.sluice.triton import model_config_pb2 as pb
from sluice_inference.worker.model_config import DeviceKind, ModelConfig, ModelConfigError, first_error

TRITON_CONFIG_FILE = "config.pbtxt"
_BACKENDS = {"pytorch_libtorch": "torchscript", "onnxruntime_onnx": "onnxruntime"}
_BACKEND_NAMES = {"pytorch": "torchscript", "onnxruntime": "onnxruntime"}
# Sections declared as empty messages in our schema, whose contents are never read: those that refuse the
# model (field, why), and those that are skipped with a warning (their field).
_REFUSED_SECTIONS = {
    "ModelSequenceBatching": ("sequence_batching", "stateful sequences are not served"),
    "ModelEnsembling": ("ensemble_scheduling", "ensembles are not served"),
    "BatchInput": ("batch_input", "ragged batch inputs are not supported"),
    "BatchOutput": ("batch_output", "ragged batch outputs are not supported"),
}
_SKIPPED_SECTIONS = {
    "ModelOptimizationPolicy": "optimization",
    "ModelWarmup": "model_warmup",
    "ModelOperations": "model_operations",
    "ModelRepositoryAgents": "model_repository_agents",
    "ModelMetrics": "model_metrics",
    "ModelRateLimiter": "instance_group.rate_limiter",
    "SecondaryDevice": "instance_group.secondary_devices",
}
_KINDS: dict[int, DeviceKind] = {
    pb.ModelInstanceGroup.KIND_AUTO: "auto",
    pb.ModelInstanceGroup.KIND_CPU: "cpu",
    pb.ModelInstanceGroup.KIND_GPU: "gpu",
}
# Set fields that change no answer and that Sluice does not apply: what happens instead.
_NOT_APPLIED = {
    "optimization": "execution accelerators and graph settings are not applied",
    "model_warmup": "Sluice warms up with zeros at every warm-up batch size instead",
    "parameters": "backend parameters are not applied",
    "model_operations": "not applied",
    "model_repository_agents": "not applied",
    "model_metrics": "not applied",
    "metric_tags": "not applied (metrics carry model and version labels)",
    "cc_model_filenames": "not applied (see default_model_filename)",
}
# Sluice's keys that a validation error may name, as the config.pbtxt field they came from.
_TRITON_KEYS = {
    "inputs": "input",
    "outputs": "output",
    "batching.max_wait_ms": "dynamic_batching",
    "warmup_batch_sizes": "dynamic_batching.preferred_batch_size",
    "filename": "default_model_filename",
}


@dataclass(frozen=True)
class TritonModel:
    """A translated `config.pbtxt`: the config Sluice serves, and what of the file it does not apply."""

    config: ModelConfig
    warnings: tuple[str, ...]


def parse_triton_config(raw: bytes, *, source: Path) -> TritonModel:
    """Translate config bytes read from `source` (`<repo>/<model>/config.pbtxt`).

    Raises ModelConfigError naming the file and the field for a file that does not parse or a model
    Sluice cannot serve as configured.
    """
    message, skipped = _parse(raw, source)
    warnings: list[str] = []
    if skipped:
        warnings.append(
            f"contents of {skipped} skipped unread (and so would be a misspelt field elsewhere in this file)"
        )
    _refuse_unservable(message, source)
    data: dict[str, Any] = {
        "name": message.name or source.parent.name,
        "backend": _backend(message, source),
        "max_batch_size": message.max_batch_size,
        "inputs": [_tensor(t, f"input.{i}", source) for i, t in enumerate(message.input)],
        "outputs": [_tensor(t, f"output.{i}", source) for i, t in enumerate(message.output)],
        "version_policy": _version_policy(message),
    }
    if message.default_model_filename:
        data["filename"] = message.default_model_filename
    if message.response_cache.enable:
        # Triton leaves it to whoever enables the cache to know the model's outputs depend only on its inputs.
        data.update(deterministic=True, cache="enabled")
    data.update(_batching(message, warnings))
    data["device"] = _device(message, warnings, source)
    warnings.extend(_unapplied(message))
    try:
        config = ModelConfig.model_validate(data)
    except ValidationError as exc:
        key, text = first_error(exc)
        prefix = next((k for k in _TRITON_KEYS if key == k or key.startswith(k + ".")), None)
        if prefix is not None:
            key = _TRITON_KEYS[prefix] + key.removeprefix(prefix)
        raise ModelConfigError(text, path=source, key=key) from None
    if config.name != source.parent.name:
        raise ModelConfigError(f"{config.name!r} must equal the folder name", path=source, key="name")
    return TritonModel(config, tuple(warnings))


def _parse(raw: bytes, source: Path) -> tuple[pb.ModelConfig, str]:
    """The parsed message, and the first section whose contents were skipped ('' when none).

    Strict first, so a misspelt field fails with its line and column; a section that refuses the model
    anyway is refused on sight; only when the first unknown field lies inside a section we skip is the
    file parsed again, skipping unknown contents.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelConfigError(f"not UTF-8 text: {exc}", path=source) from None
    try:
        return text_format.Parse(text, pb.ModelConfig()), ""
    except text_format.ParseError as exc:
        inside = next(
            (t for t in (*_REFUSED_SECTIONS, *_SKIPPED_SECTIONS) if f'"sluice.triton.{t}"' in str(exc)), ""
        )
        if inside in _REFUSED_SECTIONS:
            key, why = _REFUSED_SECTIONS[inside]
            raise ModelConfigError(why, path=source, key=key) from None
        if not inside:
            raise ModelConfigError(
                f"not a Triton model config: {_triton_names(str(exc))}", path=source
            ) from None
    section = _SKIPPED_SECTIONS[inside]
    try:
        return text_format.Parse(text, pb.ModelConfig(), allow_unknown_field=True), section
    except text_format.ParseError as exc:
        why = f"cannot skip the contents of {section}, which Sluice does not apply: {_triton_names(str(exc))}"
        raise ModelConfigError(why, path=source, key=section) from None


def _triton_names(error: str) -> str:
    """A parse error with Triton's message names (our schema's package is ours, the fields are Triton's)."""
    return error.replace('"sluice.triton.', '"inference.')


def _refuse_unservable(message: pb.ModelConfig, source: Path) -> None:
    """ModelConfigError for the first setting whose absence would change the answers clients get."""
    present = _set_fields(message)
    for key, why in _REFUSED_SECTIONS.values():
        if key in present:
            raise ModelConfigError(why, path=source, key=key)
    if message.max_batch_size <= 0:
        why = (
            f"{message.max_batch_size} is not supported (0: the model takes no batch dim): Sluice batches "
            "along a first dim; set max_batch_size >= 1 if the model's first dim is the batch"
        )
        raise ModelConfigError(why, path=source, key="max_batch_size")
    if message.model_transaction_policy.decoupled:
        why = "decoupled models (any number of responses per request) are not served"
        raise ModelConfigError(why, path=source, key="model_transaction_policy.decoupled")
    if message.runtime:
        why = f"{message.runtime!r}: only model.pt and model.onnx artifacts are served (no custom runtimes)"
        raise ModelConfigError(why, path=source, key="runtime")


def _set_fields(message: pb.ModelConfig) -> set[str]:
    """Names of the top-level fields the file sets (a present message, a non-empty list or map)."""
    return {field.name for field, _ in message.ListFields()}


def _backend(message: pb.ModelConfig, source: Path) -> str:
    by_platform = _BACKENDS.get(message.platform) if message.platform else None
    by_backend = _BACKEND_NAMES.get(message.backend) if message.backend else None
    if message.platform and by_platform is None:
        known = ", ".join(_BACKENDS)
        raise ModelConfigError(
            f"{message.platform!r} is not served (one of {known})", path=source, key="platform"
        )
    if message.backend and by_backend is None:
        known = ", ".join(_BACKEND_NAMES)
        raise ModelConfigError(
            f"{message.backend!r} is not served (one of {known})", path=source, key="backend"
        )
    if by_platform and by_backend and by_platform != by_backend:
        why = f"platform {message.platform!r} and backend {message.backend!r} disagree"
        raise ModelConfigError(why, path=source, key="backend")
    chosen = by_platform or by_backend
    if chosen is None:
        raise ModelConfigError("give platform or backend (pytorch_libtorch, onnxruntime_onnx)", path=source)
    return chosen


def _tensor(tensor: pb.ModelInput | pb.ModelOutput, key: str, source: Path) -> dict[str, Any]:
    """One input or output as a TensorConfig mapping; ModelConfigError for what changes results."""
    flags = ["is_shape_tensor", "is_non_linear_format_io"]
    if isinstance(tensor, pb.ModelInput):
        flags += ["allow_ragged_batch", "optional"]
    for flag in flags:
        if getattr(tensor, flag):
            raise ModelConfigError(
                f"{tensor.name!r}: {flag} is not supported", path=source, key=f"{key}.{flag}"
            )
    datatype = pb.DataType.Name(tensor.data_type).removeprefix("TYPE_")
    if datatype in ("INVALID", "STRING", "BF16"):
        why = f"{tensor.name!r}: data_type TYPE_{datatype} is not served (numeric and BOOL tensors only)"
        raise ModelConfigError(why, path=source, key=f"{key}.data_type")
    found: dict[str, Any] = {"name": tensor.name, "datatype": datatype, "dims": list(tensor.dims)}
    if tensor.HasField("reshape"):
        found["reshape"] = list(tensor.reshape.shape)
    return found


def _version_policy(message: pb.ModelConfig) -> dict[str, Any]:
    policy = message.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return {"all": True}
    if choice == "specific":
        return {"specific": list(policy.specific.versions)}
    if choice == "latest":
        return {"latest": policy.latest.num_versions}
    return {"latest": 1}  # Triton's default


def _batching(message: pb.ModelConfig, warnings: list[str]) -> dict[str, Any]:
    """`batching.max_wait_ms` (and warm-up sizes) from dynamic_batching; warnings for the rest of it."""
    if not message.HasField("dynamic_batching"):
        warnings.append(
            "no dynamic_batching: Triton would run each request alone; Sluice still batches requests that "
            "are queued together, but never waits for more (max_wait 0 ms)"
        )
        return {"batching": {"max_wait_ms": 0.0}}
    batching = message.dynamic_batching
    found: dict[str, Any] = {"batching": {"max_wait_ms": batching.max_queue_delay_microseconds / 1000.0}}
    preferred = sorted(set(batching.preferred_batch_size))
    if preferred:
        found["warmup_batch_sizes"] = sorted({1, *preferred, message.max_batch_size})
        warnings.append(
            f"dynamic_batching.preferred_batch_size {preferred}: warmed up at these sizes, but Sluice's "
            "batcher cuts batches by deadline and cost, not towards preferred sizes"
        )
    if batching.priority_levels or batching.default_priority_level:
        warnings.append(
            f"dynamic_batching.priority_levels {batching.priority_levels} / default_priority_level "
            f"{batching.default_priority_level}: not applied per model; Sluice's levels are cluster-wide "
            "(admission.priority_levels) and defaults are per tenant (tenants.*.default_priority)"
        )
    queue = batching.default_queue_policy
    if batching.HasField("default_queue_policy") and (
        queue.default_timeout_microseconds
        or queue.max_queue_size
        or queue.timeout_action
        or queue.allow_timeout_override
    ):
        warnings.append(
            f"dynamic_batching.default_queue_policy (timeout {queue.default_timeout_microseconds} us, "
            f"max_queue_size {queue.max_queue_size}): not applied per model; requests without a deadline get "
            "router.default_timeout_s and queues are bounded by admission (docs/admission.md)"
        )
    if batching.priority_queue_policy:
        warnings.append("dynamic_batching.priority_queue_policy: not applied (see default_queue_policy)")
    if batching.preserve_ordering:
        warnings.append("dynamic_batching.preserve_ordering: not needed (each request has its own response)")
    return found


def _device(message: pb.ModelConfig, warnings: list[str], source: Path) -> DeviceKind:
    """The instance kind (one kind per model); count and gpus are named in the warnings."""
    groups: Sequence[pb.ModelInstanceGroup] = message.instance_group
    if not groups:
        return "auto"
    if any(g.kind == pb.ModelInstanceGroup.KIND_MODEL for g in groups):
        raise ModelConfigError("KIND_MODEL is not supported", path=source, key="instance_group.kind")
    kinds = {_KINDS[g.kind] for g in groups}
    if len(kinds) > 1:
        why = f"mixes kinds {sorted(kinds)}: Sluice places a model on one kind of device"
        raise ModelConfigError(why, path=source, key="instance_group")
    count = sum(max(g.count, 1) for g in groups)
    if count > 1:
        warnings.append(
            f"instance_group count {count}: a Sluice worker runs one executor per device; run {count} "
            "workers (`sluice up --workers N`, or more worker pods) for that many concurrent instances"
        )
    gpus = sorted({gpu for g in groups for gpu in g.gpus})
    if gpus:
        warnings.append(f"instance_group.gpus {gpus}: the worker's --device chooses the GPU")
    unread = {
        "rate_limiter": any(g.HasField("rate_limiter") for g in groups),
        "secondary_devices": any(g.secondary_devices for g in groups),
        "profile": any(g.profile for g in groups),
        "passive": any(g.passive for g in groups),
        "host_policy": any(g.host_policy for g in groups),
    }
    if any(unread.values()):
        warnings.append(f"instance_group {', '.join(k for k, v in unread.items() if v)}: not applied")
    return kinds.pop()


def _unapplied(message: pb.ModelConfig) -> list[str]:
    """A warning for each set field that changes no answer and that Sluice does not apply."""
    present = _set_fields(message)
    found = [f"{name}: {why}" for name, why in _NOT_APPLIED.items() if name in present]
    formats = [t.name for t in message.input if t.format != pb.ModelInput.FORMAT_NONE]
    if formats:
        found.append(f"input format on {formats}: informational only, not applied")
    labels = [t.name for t in message.output if t.label_filename]
    if labels:
        found.append(f"output label_filename on {labels}: the classification extension is not served")
    return found
