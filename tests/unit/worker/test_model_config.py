"""ModelConfig: defaults, every cross-field rule, and errors that name the file and the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice_inference.worker.model_config import ModelConfig, ModelConfigError, VersionPolicy
from tests.unit.worker.fakes import synthetic_config


def write_config(tmp_path: Path, config: dict[str, Any], folder: str | None = None) -> Path:
    path = tmp_path / (folder or config["name"]) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def load_error(tmp_path: Path, config: dict[str, Any], folder: str | None = None) -> ModelConfigError:
    path = write_config(tmp_path, config, folder)
    with pytest.raises(ModelConfigError) as info:
        ModelConfig.load(path)
    assert str(path) in str(info.value)
    return info.value


def test_defaults(tmp_path: Path) -> None:
    config = ModelConfig.load(write_config(tmp_path, synthetic_config(max_batch_size=16)))
    assert config.batching.max_wait_ms == 2.0
    assert config.batching.pad_value == 0
    assert config.version_policy == VersionPolicy(latest=1)
    assert (config.deterministic, config.cache, config.cache_scope) == (False, "disabled", "tenant")
    assert config.warmup_sizes == (1, 16)
    assert config.inputs[0].dims == (4,)


def test_warmup_default_deduplicates_when_max_is_one(tmp_path: Path) -> None:
    config = ModelConfig.load(write_config(tmp_path, synthetic_config(max_batch_size=1)))
    assert config.warmup_sizes == (1,)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"batching": {"max_wait": 1}}, "batching.max_wait"),
        ({"colour": "blue"}, "colour"),
        ({"inputs": [{"name": "x", "datatype": "FP31", "dims": [4]}]}, "inputs.0.datatype"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "dims": [0]}]}, "inputs.0.dims"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"backend": "onnx"}, "backend"),
        ({"synthetic": None}, "synthetic"),
        ({"backend": "torch_export"}, "synthetic"),
        ({"cache": "enabled"}, "cache"),
        ({"batching": {"max_wait_ms": -1}}, "batching.max_wait_ms"),
        ({"warmup_batch_sizes": [1, 9]}, "warmup_batch_sizes"),
        ({"version_policy": {"latest": 1, "all": True}}, "version_policy"),
        ({"version_policy": {"all": False}}, "version_policy.all"),
        ({"version_policy": {"specific": [0]}}, "version_policy.specific"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "dims": [4]}] * 2}, "inputs"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, overrides: dict[str, Any], key: str) -> None:
    error = load_error(tmp_path, synthetic_config(**overrides))
    assert error.key == key
    assert f": {key}: " in str(error)


def variable_config(**batching: Any) -> dict[str, Any]:
    return synthetic_config(
        inputs=[{"name": "tokens", "datatype": "INT64", "dims": [-1]}],
        backend="torch_export",
        synthetic=None,
        batching=batching,
    )


@pytest.mark.parametrize(
    ("batching", "key"),
    [
        ({"buckets": {"tokens": [32, 16]}}, "batching.buckets"),
        ({"buckets": {"tokens": []}}, "batching.buckets"),
        ({"buckets": {"nope": [16]}}, "batching.buckets"),
        ({"mask_input": "tokens"}, "batching.mask_input"),
        ({"max_batch_cost": 0}, "batching.max_batch_cost"),
    ],
)
def test_batching_rules(tmp_path: Path, batching: dict[str, Any], key: str) -> None:
    assert load_error(tmp_path, variable_config(**batching)).key == key


def test_mask_needs_one_variable_input(tmp_path: Path) -> None:
    config = synthetic_config(batching={"mask_input": "mask"})  # x has fixed dims
    assert load_error(tmp_path, config).key == "batching.mask_input"


def test_variable_input_with_buckets_and_mask(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, variable_config(buckets={"tokens": [8, 16]}, mask_input="mask", pad_value=3)
    )
    config = ModelConfig.load(path)
    assert config.masked_input is not None and config.masked_input.name == "tokens"
    assert config.batching.buckets == {"tokens": (8, 16)}


def test_synthetic_outputs_must_be_fixed(tmp_path: Path) -> None:
    config = synthetic_config(outputs=[{"name": "y", "datatype": "FP32", "dims": [-1]}])
    assert load_error(tmp_path, config).key == "outputs"


def test_name_must_match_folder(tmp_path: Path) -> None:
    assert load_error(tmp_path, synthetic_config("toy"), folder="other").key == "name"


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "toy" / "config.yaml"
    path.parent.mkdir()
    path.write_text("name: [unclosed\n")
    with pytest.raises(ModelConfigError, match="not valid YAML"):
        ModelConfig.load(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ModelConfigError, match="mapping"):
        ModelConfig.load(path)
    with pytest.raises(ModelConfigError, match="cannot read"):
        ModelConfig.load(tmp_path / "absent" / "config.yaml")


def test_version_policy_select() -> None:
    available = [3, 1, 10, 2]
    assert VersionPolicy(latest=2).select(available) == [3, 10]
    assert VersionPolicy(latest=9).select(available) == [1, 2, 3, 10]
    assert VersionPolicy(all=True).select(available) == [1, 2, 3, 10]
    assert VersionPolicy(specific=(2, 1)).select(available) == [1, 2]
    with pytest.raises(ValueError, match=r"\[4\]"):
        VersionPolicy(specific=(1, 4)).select(available)


def ranged(datatype: str = "INT64", value_range: list[int] | None = None, **overrides: Any) -> dict[str, Any]:
    """A variable-length integer input `tokens` with buckets, declaring `range` when given."""
    tokens: dict[str, Any] = {"name": "tokens", "datatype": datatype, "dims": [-1]}
    if value_range is not None:
        tokens["range"] = value_range
    overrides.setdefault("batching", {"buckets": {"tokens": [8]}})
    return variable_config() | {"inputs": [tokens], **overrides}


def test_integer_input_range(tmp_path: Path) -> None:
    config = ModelConfig.load(write_config(tmp_path, ranged(value_range=[0, 999])))
    assert config.inputs[0].range == (0, 999)
    assert config.outputs[0].range is None
    signed = ModelConfig.load(write_config(tmp_path, ranged("INT8", [-128, 127], name="small"), "small"))
    assert signed.inputs[0].range == (-128, 127)


@pytest.mark.parametrize(
    ("config", "key", "message"),
    [
        (ranged("FP32", [0, 9]), "inputs.0.range", "only integer datatypes"),
        (ranged(value_range=[10, 9]), "inputs.0.range", "lo must be <= hi"),
        (ranged("UINT8", [0, 256]), "inputs.0.range", "exceeds UINT8"),
        (ranged("UINT8", [-1, 9]), "inputs.0.range", "exceeds UINT8"),
        (ranged(value_range=[0]), "inputs.0.range.1", "required"),
        (ranged(value_range=[1, 9]), "batching.pad_value", "outside inputs.0.range"),
        (
            ranged(outputs=[{"name": "y", "datatype": "INT64", "dims": [2], "range": [0, 1]}]),
            "outputs.0.range",
            "inputs only",
        ),
    ],
)
def test_range_errors_name_the_key(tmp_path: Path, config: dict[str, Any], key: str, message: str) -> None:
    error = load_error(tmp_path, config)
    assert error.key == key
    assert message in str(error)
