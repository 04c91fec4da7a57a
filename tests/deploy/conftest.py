"""Fixtures for the deploy/ tests: each overlay rendered once per session (kubectl kustomize, ≈ 0.1 s)."""

from __future__ import annotations

import pytest

from tests.deploy.rendering import OVERLAYS, Rendered, render_overlay


@pytest.fixture(scope="session")
def overlays() -> dict[str, Rendered]:
    """Every overlay under deploy/overlays, rendered; treat as read-only (copy before mutating)."""
    return {name: render_overlay(name) for name in OVERLAYS}
