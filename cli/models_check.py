"""`sluice models check DIR`: validate a model repository offline and print what each model will be
served as, without etcd, a router or a worker.

Checks, in order: the layout and every config (config.yaml or Triton's config.pbtxt: the same code the
worker runs, so a repository that passes is one a worker accepts), then, unless `--no-load`, each
artifact loaded on the CPU with its backend (signature and graph checks included). Loading needs the
worker's packages (`sluice-inference[worker]`, `[onnx]` for ONNX models); without them the configs are
still checked and the command says what it could not try. Exit 0 when nothing is wrong, 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sluice_inference.worker.model_config import ModelConfigError, TensorConfig
from sluice_inference.worker.repository import ModelVersionSpec, scan_repository

EXIT_OK, EXIT_PROBLEM = 0, 1


def check_repository(root: Path, *, load: bool) -> int:
    """Print each model version as it will be served; the exit code."""
    try:
        specs = scan_repository(root)
    except ModelConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
    if not specs:
        print(f"error: no models in {root}", file=sys.stderr)
        return EXIT_PROBLEM
    problems = 0
    warned: set[str] = set()
    for spec in specs:
        print(describe(spec))
        if spec.warnings and spec.name not in warned:
            warned.add(spec.name)
            for warning in spec.warnings:
                print(f"  warning: {warning}")
        if load:
            problems += _try_load(spec)
    print(f"{len(specs)} model version(s) in {root}: " + ("OK" if not problems else f"{problems} problem(s)"))
    return EXIT_PROBLEM if problems else EXIT_OK


def describe(spec: ModelVersionSpec) -> str:
    """What clients will see of one model version, and how it is batched and placed."""
    config = spec.config
    source = spec.config_path.name if spec.config_path else "?"
    artifact = spec.artifact.name if spec.artifact else "(simulated, no artifact)"
    cache = f"cache on ({config.cache_scope})" if config.cache == "enabled" else "cache off"
    return "\n".join(
        [
            f"{spec.name} v{spec.version}: {config.backend} from {source}, artifact {artifact}",
            f"  inputs  {', '.join(_tensor(t) for t in config.inputs)}",
            f"  outputs {', '.join(_tensor(t) for t in config.outputs)}",
            f"  max_batch_size {config.max_batch_size}, max_wait {config.batching.max_wait_ms:g} ms, "
            f"warm-up batches {list(config.warmup_sizes)}, device {config.device}, "
            f"{'deterministic' if config.deterministic else 'not deterministic'}, {cache}",
            f"  digest {spec.digest}",
        ]
    )


def _tensor(tensor: TensorConfig) -> str:
    shape = f"{tensor.name} {tensor.datatype}{[-1, *tensor.dims]}"
    return shape + (f" (model sees {[-1, *tensor.reshape]})" if tensor.reshape is not None else "")


def _try_load(spec: ModelVersionSpec) -> int:
    """Load the artifact on the CPU; 1 if that fails (printed), 0 otherwise (or when it cannot be tried)."""
    if spec.config.backend == "synthetic":
        return 0
    if spec.config.device == "gpu":
        print("  load not tried: device gpu needs a CUDA worker")
        return 0
    try:
        from sluice_inference.worker.backends import load_backend
    except ImportError as exc:
        print(f"  load not tried: {exc.name} is not installed (pip install 'sluice-inference[worker]')")
        return 0
    try:
        backend = load_backend(spec, "cpu")
    except ModelConfigError as exc:
        print(f"  error: {exc}")
        return 1
    signature = getattr(backend, "signature", "")
    print(f"  loaded on cpu{': ' + signature if signature else ''}")
    return 0
