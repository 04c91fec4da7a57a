"""Session-wide fixtures: the demo model repository, generated once (≈ 2 s) into a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_inference.worker.demo_models import init_demo_repository


@pytest.fixture(scope="session")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly generated demo model repository (read-only by convention)."""
    root = tmp_path_factory.mktemp("demo-models")
    init_demo_repository(root)
    return root
