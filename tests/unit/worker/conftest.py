"""Fixtures for worker unit tests: the demo models (from the session's `demo_repo`, tests/conftest.py)
are loaded once; tests must not mutate them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_inference.worker.executor import Executor, LoadedModel
from sluice_inference.worker.repository import scan_repository


@pytest.fixture(scope="session")
def executor() -> Executor:
    """A CPU executor with one intra-op thread."""
    return Executor(device="cpu", torch_threads=1)


@pytest.fixture(scope="session")
def demo_models(demo_repo: Path, executor: Executor) -> dict[str, LoadedModel]:
    """The demo models loaded on the CPU executor, by name."""
    return {spec.name: executor.load(spec) for spec in scan_repository(demo_repo)}
