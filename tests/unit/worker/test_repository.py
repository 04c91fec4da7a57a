"""Repository scanning: layout rules, version policies, digests, and the record a worker publishes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sluice_inference.worker.model_config import ModelConfigError
from sluice_inference.worker.repository import RepositoryError, model_digest, scan_repository
from tests.unit.worker.fakes import synthetic_config, write_model


def export_config(name: str = "net", **overrides: object) -> dict[str, object]:
    return synthetic_config(name, backend="torch_export", synthetic=None, **overrides)


def test_scan_sorted_with_defaults(tmp_path: Path) -> None:
    write_model(tmp_path, synthetic_config("b"), versions=(1, 2))
    write_model(tmp_path, export_config("a"), artifact=b"weights")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".generated").write_text("")
    specs = scan_repository(tmp_path)
    assert [(s.name, s.version) for s in specs] == [("a", "1"), ("b", "2")]  # latest: 1 by default
    assert specs[0].artifact == tmp_path / "a" / "1" / "model.pt2"
    assert specs[1].artifact is None
    assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", s.digest) for s in specs)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ({"latest": 2}, ["3", "10"]),
        ({"all": True}, ["1", "3", "10"]),
        ({"specific": [1, 10]}, ["1", "10"]),
    ],
)
def test_version_policy(tmp_path: Path, policy: dict[str, object], expected: list[str]) -> None:
    write_model(tmp_path, synthetic_config(version_policy=policy), versions=(1, 3, 10, "01", "x"))
    assert [s.version for s in scan_repository(tmp_path)] == expected


def test_specific_version_missing(tmp_path: Path) -> None:
    write_model(tmp_path, synthetic_config(version_policy={"specific": [2]}), versions=(1,))
    with pytest.raises(RepositoryError, match=r"toy/config.yaml.*\[2\]"):
        scan_repository(tmp_path)


def test_digest_tracks_config_and_artifact_bytes(tmp_path: Path) -> None:
    folder = write_model(tmp_path, export_config(), artifact=b"weights-v1")
    first = scan_repository(tmp_path)[0].digest
    assert scan_repository(tmp_path)[0].digest == first
    (folder / "1" / "model.pt2").write_bytes(b"weights-v2")
    second = scan_repository(tmp_path)[0].digest
    config_path = folder / "config.yaml"
    config_path.write_bytes(config_path.read_bytes() + b"# a comment changes the bytes\n")
    third = scan_repository(tmp_path)[0].digest
    assert len({first, second, third}) == 3


def test_digest_is_unambiguous_between_config_and_artifact(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.write_bytes(b"cd")
    two.write_bytes(b"d")
    assert model_digest(b"ab", one) != model_digest(b"abc", two)
    assert model_digest(b"ab", None) != model_digest(b"ab", one)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("no_config", "missing config.yaml"),
        ("no_versions", "no numeric version folders"),
        ("no_artifact", "missing model.pt2"),
    ],
)
def test_broken_models_name_the_path(tmp_path: Path, setup: str, message: str) -> None:
    if setup == "no_config":
        (tmp_path / "net" / "1").mkdir(parents=True)
    elif setup == "no_versions":
        write_model(tmp_path, export_config(), versions=())
    else:
        write_model(tmp_path, export_config(), artifact=None)
    with pytest.raises(RepositoryError, match=message) as info:
        scan_repository(tmp_path)
    assert str(tmp_path / "net") in str(info.value)


def test_bad_config_propagates_with_key(tmp_path: Path) -> None:
    write_model(tmp_path, synthetic_config(max_batch_size=0))
    with pytest.raises(ModelConfigError, match="max_batch_size"):
        scan_repository(tmp_path)


def test_only_filters_and_checks_names(tmp_path: Path) -> None:
    write_model(tmp_path, synthetic_config("a"))
    write_model(tmp_path, synthetic_config("b", max_batch_size=0))  # broken, but not asked for
    assert [s.name for s in scan_repository(tmp_path, only=["a"])] == ["a"]
    with pytest.raises(RepositoryError, match="'c' not found"):
        scan_repository(tmp_path, only=["a", "c"])
    with pytest.raises(RepositoryError, match="not found"):
        scan_repository(tmp_path / "absent")


def test_record(tmp_path: Path) -> None:
    config = export_config(
        batching={"max_wait_ms": 5}, outputs=[{"name": "y", "datatype": "INT64", "dims": [2]}]
    )
    write_model(tmp_path, config, artifact=b"w")
    spec = scan_repository(tmp_path)[0]
    record = spec.record()
    assert (record.name, record.version, record.digest) == ("net", "1", spec.digest)
    assert (record.platform, record.max_batch_size, record.max_wait_s) == ("torch_export", 8, 0.005)
    assert [(t.name, t.datatype, t.dims) for t in record.inputs] == [("x", "FP32", (4,))]
    assert [(t.name, t.datatype, t.dims) for t in record.outputs] == [("y", "INT64", (2,))]
    assert record.inputs[0].range is None


def test_record_publishes_input_ranges(tmp_path: Path) -> None:
    config = export_config(inputs=[{"name": "ids", "datatype": "INT32", "dims": [3], "range": [0, 49]}])
    write_model(tmp_path, config, artifact=b"w")
    [spec] = scan_repository(tmp_path)
    assert spec.record().inputs[0].range == (0, 49)
