"""The model repository on disk: which model versions this worker serves, and their digests.

Layout (DESIGN §7): `<root>/<name>/config.yaml` (Sluice's format) or `<root>/<name>/config.pbtxt` (Triton's,
translated by worker/triton_config.py), never both, plus numeric version folders `<root>/<name>/<version>/`
holding `model.pt2` (torch_export), `model.pt` (torchscript) or `model.onnx` (onnxruntime), or the config's
`filename`; synthetic versions need only the folder. Both formats may sit side by side in one repository.
Version folders are positive integers written without leading zeros; other folders and hidden entries are
ignored. Invariants: a returned spec's config is valid and its artifact existed when scanned; the digest
covers exactly the config bytes that were parsed and the artifact bytes, so two workers agree on a digest
only when they serve byte-identical models. A broken model fails the whole scan (a worker must not come
up serving a subset by accident) with an error naming the path.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice_inference.common.records import ModelRecord, TensorSpec
from sluice_inference.worker.model_config import ModelConfig, ModelConfigError, TensorConfig
from sluice_inference.worker.triton_config import TRITON_CONFIG_FILE, parse_triton_config

CONFIG_FILE = "config.yaml"
ARTIFACT_FILES: dict[str, str] = {
    "torch_export": "model.pt2",
    "torchscript": "model.pt",
    "onnxruntime": "model.onnx",
}
_VERSION = re.compile(r"^[1-9][0-9]*$")
# Bumped if the digest's construction ever changes, so old and new digests can never collide.
_DIGEST_DOMAIN = b"sluice-model-digest-v1\x00"


class RepositoryError(ModelConfigError):
    """The repository layout is wrong: a missing folder, config or artifact (names the path)."""


@dataclass(frozen=True)
class ModelVersionSpec:
    """One model version chosen by the version policy, ready to be loaded by a backend."""

    name: str
    version: str
    config: ModelConfig
    artifact: Path | None
    digest: str
    warnings: tuple[str, ...] = ()
    """What of a config.pbtxt Sluice does not apply (logged once when the model loads)."""
    config_path: Path | None = None
    """The config file the model was read from."""

    def record(self) -> ModelRecord:
        """What the worker publishes in etcd for this version once it is loaded and warm."""
        return ModelRecord(
            name=self.name,
            version=self.version,
            digest=self.digest,
            platform=self.config.backend,
            max_batch_size=self.config.max_batch_size,
            max_wait_s=self.config.batching.max_wait_ms / 1000.0,
            inputs=tuple(_tensor_spec(t) for t in self.config.inputs),
            outputs=tuple(_tensor_spec(t) for t in self.config.outputs),
            deterministic=self.config.deterministic,
            cache=self.config.cache == "enabled",
            cache_scope=self.config.cache_scope,
            buckets={name: tuple(sizes) for name, sizes in self.config.batching.buckets.items()},
            max_batch_cost=self.config.batching.max_batch_cost,
        )


def _tensor_spec(tensor: TensorConfig) -> TensorSpec:
    return TensorSpec(name=tensor.name, datatype=tensor.datatype, dims=tensor.dims, range=tensor.range)


def model_digest(config_bytes: bytes, artifact: Path | None) -> str:
    """`sha256:<hex>` over the config bytes and the artifact bytes (each hashed on its own, so the split
    between them is unambiguous); a synthetic model without an artifact hashes an empty artifact."""
    outer = hashlib.sha256(_DIGEST_DOMAIN)
    outer.update(hashlib.sha256(config_bytes).digest())
    if artifact is None:
        outer.update(hashlib.sha256(b"").digest())
    else:
        with artifact.open("rb") as f:
            outer.update(hashlib.file_digest(f, "sha256").digest())
    return "sha256:" + outer.hexdigest()


def scan_repository(root: Path, only: Sequence[str] = ()) -> list[ModelVersionSpec]:
    """Every model version under `root` that its version policy selects, sorted by (name, version).

    `only` restricts the scan to those model names (each must exist). Raises ModelConfigError (or its
    subclass RepositoryError) naming the offending path.
    """
    if not root.is_dir():
        raise RepositoryError("model repository folder not found", path=root)
    if only:
        names = sorted(set(only))
        for name in names:
            if not (root / name).is_dir():
                raise RepositoryError(f"model {name!r} not found in the repository", path=root / name)
    else:
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    specs: list[ModelVersionSpec] = []
    for name in names:
        specs.extend(_scan_model(root / name))
    return specs


def _read_config(folder: Path) -> tuple[Path, bytes, ModelConfig, tuple[str, ...]]:
    """(config path, its bytes, the config, warnings) from whichever of the two formats the folder has."""
    yaml_path, triton_path = folder / CONFIG_FILE, folder / TRITON_CONFIG_FILE
    if yaml_path.is_file() and triton_path.is_file():
        raise RepositoryError(f"both {CONFIG_FILE} and {TRITON_CONFIG_FILE}: keep one", path=folder)
    if yaml_path.is_file():
        raw = yaml_path.read_bytes()
        return yaml_path, raw, ModelConfig.from_yaml(raw, source=yaml_path), ()
    if triton_path.is_file():
        raw = triton_path.read_bytes()
        translated = parse_triton_config(raw, source=triton_path)
        return triton_path, raw, translated.config, translated.warnings
    raise RepositoryError(f"missing {CONFIG_FILE} (or Triton's {TRITON_CONFIG_FILE})", path=folder)


def _scan_model(folder: Path) -> list[ModelVersionSpec]:
    config_path, raw, config, warnings = _read_config(folder)
    available = [int(p.name) for p in folder.iterdir() if p.is_dir() and _VERSION.match(p.name)]
    if not available:
        raise RepositoryError("no numeric version folders (e.g. 1/)", path=folder)
    try:
        versions = config.version_policy.select(available)
    except ValueError as exc:
        raise RepositoryError(str(exc), path=config_path) from None
    specs = []
    for version in versions:
        artifact = _artifact(folder / str(version), config)
        specs.append(
            ModelVersionSpec(
                name=config.name,
                version=str(version),
                config=config,
                artifact=artifact,
                digest=model_digest(raw, artifact),
                warnings=warnings,
                config_path=config_path,
            )
        )
    return specs


def _artifact(version_folder: Path, config: ModelConfig) -> Path | None:
    if config.backend == "synthetic":  # simulated, nothing to load
        return None
    filename = config.filename or ARTIFACT_FILES[config.backend]
    artifact = version_folder / filename
    if not artifact.is_file():
        raise RepositoryError(f"missing {filename} for backend {config.backend}", path=artifact)
    return artifact
