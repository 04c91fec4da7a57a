"""bench/gc_trace: a traced Sluice process writes its collections per generation; any other process is left
alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import sluice_inference.bench

TRACE_DIR = Path(sluice_inference.bench.__file__).parent / "gc_trace"
PROGRAM = """
import gc
for _ in range(3):
    gc.collect(2)
"""


def _run(tmp_path: Path, *argv: str) -> list[Path]:
    env = dict(
        os.environ, PYTHONPATH=str(TRACE_DIR), SLUICE_GC_TRACE=str(tmp_path), SLUICE_GC_TRACE_AFTER_S="0"
    )
    subprocess.run([sys.executable, "-", *argv], input=PROGRAM, text=True, env=env, timeout=60, check=True)
    return sorted(tmp_path.glob("*.json"))


def test_a_router_process_writes_its_collections(tmp_path: Path) -> None:
    written = _run(tmp_path, "router", "--listen", "127.0.0.1:0")
    assert [path.name.split("-")[0] for path in written] == ["router"]
    oldest = json.loads(written[0].read_text())["generations"]["2"]
    assert oldest["collections"] >= 3
    assert 0 < oldest["longest_s"] <= oldest["cpu_s"]


def test_any_other_process_is_not_traced(tmp_path: Path) -> None:
    assert _run(tmp_path, "client") == []
