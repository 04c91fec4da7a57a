"""Fixtures for worker unit tests: the demo repository is exported once per session (≈ 2 s) into a tmp
dir, and its models are loaded once; tests must not mutate either."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.demo_models import init_demo_repository
from worker.executor import Executor, LoadedModel
from worker.repository import scan_repository


@pytest.fixture(scope="session")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly generated demo model repository (read-only by convention)."""
    root = tmp_path_factory.mktemp("demo-models")
    init_demo_repository(root)
    return root


@pytest.fixture(scope="session")
def executor() -> Executor:
    """A CPU executor with one intra-op thread."""
    return Executor(device="cpu", torch_threads=1)


@pytest.fixture(scope="session")
def demo_models(demo_repo: Path, executor: Executor) -> dict[str, LoadedModel]:
    """The demo models loaded on the CPU executor, by name."""
    return {spec.name: executor.load(spec) for spec in scan_repository(demo_repo)}
