"""bench/scratch.py: a bench's folder goes when it ends well and stays, named, when it fails."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from sluice_inference.bench.scratch import scratch_folder


@pytest.fixture(autouse=True)
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_run_that_ends_well_leaves_nothing(temp_root: Path) -> None:
    with scratch_folder("sluice-x-") as folder:
        (folder / "etcd").mkdir()
        (folder / "etcd" / "wal").write_bytes(b"0" * 1024)
        assert folder.parent == temp_root and folder.name.startswith("sluice-x-")
    assert list(temp_root.iterdir()) == []


def test_a_failed_run_keeps_its_folder_and_says_where(
    temp_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(RuntimeError, match="cluster did not start"), scratch_folder("sluice-x-") as folder:
        (folder / "router.log").write_text("the reason")
        raise RuntimeError("cluster did not start")
    assert (folder / "router.log").read_text() == "the reason"
    assert f"kept the run's folder, with its logs: {folder}" in capsys.readouterr().err
