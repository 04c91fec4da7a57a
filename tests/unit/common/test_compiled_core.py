"""common/compiled_core.py: the compiled policy core is used only while it matches the sources, and decides
exactly as the Python it was compiled from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sluice_inference.bench.sim.engine as engine_module
import sluice_inference.router.policy.core as core_module
from sluice_inference.common import compiled_core
from sluice_inference.common.compiled_core import (
    BUILD_DIR,
    MANIFEST,
    PACKAGE_DIR,
    ROOT,
    CompiledCoreFinder,
    compiled_sources,
    source_closure,
    source_key,
)
from sluice_inference.common.core_build import current_key, up_to_date

SCENARIOS = ("sim_failures.yaml", "sim_hol.yaml", "sim_quota_shares.yaml", "sim_steady.yaml")
"""Small scenarios whose runs touch lost workers, head-of-line waits, quota shares and every policy."""


def _manifest(**changes: object) -> dict[str, object]:
    manifest: dict[str, object] = json.loads(MANIFEST.read_text(encoding="utf-8"))
    manifest.update(changes)
    return manifest


def _build_matches() -> bool:
    key, _ = current_key()
    return up_to_date(key)


def test_a_builds_key_covers_what_the_core_imports_and_nothing_it_does_not() -> None:
    closure = {path.relative_to(PACKAGE_DIR).as_posix() for path in source_closure(compiled_sources())}
    assert {"router/policy/core.py", "common/batching.py", "bench/sim/engine.py"} <= closure
    assert "common/errors.py" in closure  # imported by the core, compiled against: a change must rebuild
    assert "router/policy/__init__.py" in closure and "__init__.py" in closure
    assert not any(path.startswith(("worker/", "cli/")) for path in closure)
    assert (
        "router/driver.py" not in closure
    )  # the asyncio shell is not compiled and the core never imports it


def test_the_key_changes_with_any_covered_source(tmp_path: Path) -> None:
    sources = [tmp_path / "a.py", tmp_path / "b.py"]
    for path in sources:
        path.write_text("x = 1\n")
    before = source_key(sources, root=tmp_path)
    sources[1].write_text("x = 2\n")
    edited = source_key(sources, root=tmp_path)
    sources[1].write_text("x = 1\n")
    assert edited != before and source_key(sources, root=tmp_path) == before


@pytest.mark.skipif(not MANIFEST.is_file(), reason="no compiled build here (make compile)")
def test_a_build_whose_key_does_not_match_serves_nothing() -> None:
    finder = CompiledCoreFinder(_manifest(key="0" * 64))
    assert finder.find_spec("sluice_inference.router.policy.core", None) is None
    assert finder.verdict() == "the sources changed since the last make compile"
    assert finder.find_spec("sluice_inference.router.policy.lanes", None) is None  # all or none


@pytest.mark.skipif(not MANIFEST.is_file(), reason="no compiled build here (make compile)")
def test_an_incomplete_build_serves_nothing() -> None:
    manifest = _manifest()
    modules = dict(manifest["modules"])  # type: ignore[call-overload]
    modules["sluice_inference.router.policy.core"] = "gone/core.so"
    finder = CompiledCoreFinder({**manifest, "modules": modules})
    assert finder.find_spec("sluice_inference.router.policy.core", None) is None
    assert "incomplete" in finder.verdict()


def test_the_finder_serves_only_the_modules_its_build_holds() -> None:
    finder = CompiledCoreFinder({"key": "k", "modules": {"a.b": "x.so"}, "sources": []})
    assert finder.find_spec("sluice_inference.router.driver", None) is None
    assert finder.find_spec("json", None) is None


def test_this_process_runs_the_build_exactly_when_it_matches_the_sources() -> None:
    """`make test` compiles first, so the suite runs the compiled core; after an edit (`make check` does not
    compile) the same modules load from their sources, and `status` says why."""
    compiled = compiled_core.is_compiled(core_module)
    assert compiled_core.is_compiled(engine_module) == compiled
    if not MANIFEST.is_file() or os.environ.get(compiled_core.PURE_PYTHON_ENV, "") not in ("", "0"):
        assert not compiled and compiled_core.status().startswith("pure Python")
    elif _build_matches():
        assert compiled, compiled_core.status()
        assert core_module.__file__ is not None and Path(core_module.__file__).is_relative_to(BUILD_DIR)
        assert compiled_core.status().startswith("compiled (mypyc")
    else:
        assert not compiled
        assert compiled_core.status() == "pure Python (the sources changed since the last make compile)"


def _fingerprints(*, pure: bool) -> str:
    env = {**os.environ, compiled_core.PURE_PYTHON_ENV: "1" if pure else "0"}
    scenarios = [str(ROOT / "bench" / "scenarios" / name) for name in SCENARIOS]
    run = subprocess.run(
        [sys.executable, "-m", "sluice_inference.bench.sim.fingerprint", *scenarios],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return run.stdout


@pytest.mark.skipif(not _build_matches(), reason="no compiled build of these sources (make compile)")
def test_the_compiled_core_decides_exactly_as_its_sources() -> None:
    """Every request's outcome, latency and batch, each worker's counters and every cut reason, over each
    scenario's runs (fingerprint.py), from the compiled core and from pure Python in child processes."""
    compiled, pure = _fingerprints(pure=False).splitlines(), _fingerprints(pure=True).splitlines()
    assert compiled[-1].startswith("policy core: compiled (mypyc")
    assert pure[-1] == f"policy core: pure Python ({compiled_core.PURE_PYTHON_ENV} is set)"
    assert len(compiled) >= 4 * len(SCENARIOS)  # a scenario's runs: as written, then its variants
    assert compiled[:-1] == pure[:-1]
