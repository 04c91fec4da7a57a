"""config.pbtxt → ModelConfig: what is translated, what refuses the model, what the load warning names."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_inference.worker.model_config import ModelConfigError
from sluice_inference.worker.repository import RepositoryError, scan_repository
from sluice_inference.worker.triton_config import TritonModel, parse_triton_config

BASE = """
platform: "pytorch_libtorch"
max_batch_size: 16
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3, 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ -1 ] } ]
"""


def parse(extra: str = "", base: str = BASE, folder: str = "m") -> TritonModel:
    return parse_triton_config((base + extra).encode(), source=Path("repo", folder, "config.pbtxt"))


def refused(extra: str, base: str = BASE) -> str:
    with pytest.raises(ModelConfigError) as info:
        parse(extra, base)
    return str(info.value)


def test_minimal_config_translates_with_tritons_defaults() -> None:
    model = parse()
    config = model.config
    assert (config.name, config.backend, config.max_batch_size) == ("m", "torchscript", 16)
    assert [(t.name, t.datatype, t.dims) for t in config.inputs] == [("INPUT__0", "FP32", (3, 4))]
    assert [(t.name, t.datatype, t.dims) for t in config.outputs] == [("OUTPUT__0", "INT64", (-1,))]
    assert config.version_policy.latest == 1
    assert (config.deterministic, config.cache, config.device, config.filename) == (
        False,
        "disabled",
        "auto",
        None,
    )
    # Without dynamic_batching Triton runs requests alone: Sluice never waits for more, and says so.
    assert config.batching.max_wait_ms == 0
    assert len(model.warnings) == 1 and "no dynamic_batching" in model.warnings[0]


def test_supported_fields_map_to_sluice_settings() -> None:
    model = parse(
        """
        name: "m"
        backend: "pytorch"
        default_model_filename: "weights.pt"
        version_policy { specific { versions: [ 1, 3 ] } }
        dynamic_batching { max_queue_delay_microseconds: 2500 }
        instance_group [ { kind: KIND_GPU } ]
        response_cache { enable: true }
        """
    )
    config = model.config
    assert config.batching.max_wait_ms == 2.5
    assert config.version_policy.specific == (1, 3)
    assert (config.filename, config.device) == ("weights.pt", "gpu")
    assert (config.deterministic, config.cache) == (True, "enabled")
    assert model.warnings == ()
    assert parse("version_policy: { all: {} } dynamic_batching {}").config.version_policy.all is True
    assert parse("version_policy { latest { num_versions: 2 } }").config.version_policy.latest == 2


def test_reshape_is_read_and_checked() -> None:
    reshaped = parse(
        "",
        'platform: "onnxruntime_onnx" max_batch_size: 4 '
        'input [ { name: "a" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ] '
        'output [ { name: "b" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape: { shape: [ 6 ] } } ] '
        "dynamic_batching {}",
    ).config
    assert reshaped.inputs[0].reshape == () and reshaped.outputs[0].reshape == (6,)
    message = refused("", BASE.replace("dims: [ 3, 4 ] }", "dims: [ 3, 4 ] reshape: { shape: [ 5 ] } }"))
    assert "input.0.reshape" in message and "holds 5 elements" in message


def test_unapplied_fields_are_named_in_the_warning() -> None:
    model = parse(
        """
        dynamic_batching {
          preferred_batch_size: [ 4, 8 ]
          priority_levels: 3
          default_priority_level: 2
          default_queue_policy { default_timeout_microseconds: 100000 }
        }
        instance_group [ { count: 2 kind: KIND_CPU gpus: [ 0 ] } ]
        parameters { key: "INFERENCE_MODE" value { string_value: "true" } }
        optimization { execution_accelerators { gpu_execution_accelerator : [ { name : "tensorrt" } ] } }
        model_warmup [ { name: "zeros" batch_size: 1 } ]
        """
    )
    text = "\n".join(model.warnings)
    for named in ("preferred_batch_size [4, 8]", "priority_levels 3", "default_queue_policy",
                  "router.default_timeout_s", "instance_group count 2", "instance_group.gpus [0]",
                  "parameters", "optimization", "model_warmup", "skipped unread"):  # fmt: skip
        assert named in text, named
    assert model.config.warmup_batch_sizes == (1, 4, 8, 16)
    assert model.config.device == "cpu"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ("sequence_batching { max_sequence_idle_microseconds: 5000000 }", "sequence_batching"),
        ('ensemble_scheduling { step [ { model_name: "a" model_version: -1 } ] }', "ensemble_scheduling"),
        ("model_transaction_policy { decoupled: true }", "model_transaction_policy.decoupled"),
        ("batch_input [ { kind: BATCH_ELEMENT_COUNT } ]", "batch_input"),
        ('runtime: "model.py"', "runtime"),
        ("instance_group [ { kind: KIND_MODEL } ]", "KIND_MODEL"),
        ("instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]", "mixes kinds"),
        ('name: "other"', "must equal the folder name"),
    ],
)
def test_what_would_change_answers_refuses_the_model(extra: str, named: str) -> None:
    assert named in refused(extra)


@pytest.mark.parametrize(
    ("base", "named"),
    [
        (
            BASE.replace("max_batch_size: 16", "max_batch_size: 0"),
            "max_batch_size: 0 is not supported (0: the model takes no batch dim)",
        ),
        (BASE.replace('"pytorch_libtorch"', '"tensorrt_plan"'), "platform: 'tensorrt_plan' is not served"),
        (BASE.replace('platform: "pytorch_libtorch"', ""), "give platform or backend"),
        (BASE.replace("TYPE_FP32", "TYPE_STRING"), "input.0.data_type"),
        (BASE.replace("dims: [ 3, 4 ] }", "dims: [ 3, 4 ] optional: true }"), "input.0.optional"),
        (BASE.replace("dims: [ 3, 4 ] }", "dims: [ 3, 4 ] allow_ragged_batch: true }"), "allow_ragged_batch"),
        (BASE.replace("dims: [ 3, 4 ]", "dims: [ 3, 0 ]"), "input.0.dims"),
        (BASE + "dynamic_batchin {}", 'no field named "dynamic_batchin"'),
        (BASE.replace("max_batch_size: 16", "max_batch_size: 16 batch_size: 4"), '"inference.ModelConfig"'),
    ],
)
def test_bad_configs_name_the_field(base: str, named: str) -> None:
    assert named in refused("", base)


def test_a_misspelt_field_names_its_line(tmp_path: Path) -> None:
    message = refused("\ndynamic_batching { max_queue_delay_microsecond: 100 }\n")
    assert "7:20" in message and 'no field named "max_queue_delay_microsecond"' in message


def test_repository_reads_both_formats_side_by_side(tmp_path: Path) -> None:
    (tmp_path / "t" / "1").mkdir(parents=True)
    (tmp_path / "t" / "1" / "model.pt").write_bytes(b"artifact")
    (tmp_path / "t" / "config.pbtxt").write_text(BASE + "dynamic_batching {}")
    (tmp_path / "s" / "1").mkdir(parents=True)
    (tmp_path / "s" / "config.yaml").write_text(
        "name: s\nbackend: synthetic\nmax_batch_size: 2\nsynthetic: {base_ms: 0, per_item_ms: 0}\n"
        "inputs: [{name: x, datatype: FP32, dims: [1]}]\noutputs: [{name: y, datatype: FP32, dims: [1]}]\n"
    )
    specs = scan_repository(tmp_path)
    assert [(s.name, s.config.backend, s.config_path) for s in specs] == [
        ("s", "synthetic", tmp_path / "s" / "config.yaml"),
        ("t", "torchscript", tmp_path / "t" / "config.pbtxt"),
    ]
    assert specs[1].artifact == tmp_path / "t" / "1" / "model.pt"
    (tmp_path / "t" / "config.yaml").write_text("name: t\n")
    with pytest.raises(RepositoryError, match=r"both config\.yaml and config\.pbtxt"):
        scan_repository(tmp_path)


def test_default_model_filename_names_the_artifact(tmp_path: Path) -> None:
    (tmp_path / "t" / "2").mkdir(parents=True)
    (tmp_path / "t" / "config.pbtxt").write_text(BASE + 'dynamic_batching {} default_model_filename: "w.pt"')
    with pytest.raises(RepositoryError, match=r"missing w\.pt"):
        scan_repository(tmp_path)
    (tmp_path / "t" / "2" / "w.pt").write_bytes(b"x")
    [spec] = scan_repository(tmp_path)
    assert spec.artifact == tmp_path / "t" / "2" / "w.pt"
