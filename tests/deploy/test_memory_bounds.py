"""The router's documented memory bounds add up to less than the memory limit its pods run under.

docs/security.md ("Limits") lists what a router may hold: its baseline, the in-flight byte budget (queued
inputs included), bodies being received, the result cache and in-process idempotency records. Each is a
config bound; `sluice_inference.common.config.router_memory_bound` adds them up from the config each overlay
mounts, and the sum must stay below the container's `resources.limits.memory`, or a hostile load could get the
pod OOM-killed instead of refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sluice_inference.common.config import SluiceConfig, router_memory_bound
from tests.deploy.rendering import OVERLAYS, Obj, Rendered, containers, pod_spec
from tests.deploy.sluice_cli import effective_config

_UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity (`1Gi`, `512Mi`, `1500M`) in bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?|k)?", str(text))
    if match is None:
        raise ValueError(f"not a memory quantity: {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _router(rendered: Rendered) -> tuple[Obj, Obj]:
    workload = rendered.get("Deployment", "sluice-router")
    return workload, next(c for c in containers(pod_spec(workload)) if c["name"] == "router")


def headroom(config: SluiceConfig, limit: int) -> int:
    """Bytes left under the limit once every bound is full (negative: the bounds exceed it)."""
    return limit - sum(router_memory_bound(config).values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_bounds_fit_its_memory_limit(
    overlays: dict[str, Rendered], overlay: str, tmp_path: Path
) -> None:
    workload, container = _router(overlays[overlay])
    limit = quantity_bytes(container["resources"]["limits"]["memory"])
    config = effective_config(overlays[overlay], workload, container, tmp_path)
    assert headroom(config, limit) > 0, router_memory_bound(config)


def test_the_check_catches_bounds_that_exceed_the_limit(
    overlays: dict[str, Rendered], tmp_path: Path
) -> None:
    workload, container = _router(overlays["prod-gpu"])
    config = effective_config(overlays["prod-gpu"], workload, container, tmp_path)
    limit = quantity_bytes(container["resources"]["limits"]["memory"])
    bigger = config.model_copy(update={"cache": config.cache.model_copy(update={"memory_bytes": limit})})
    assert headroom(bigger, limit) < 0


def test_quantities() -> None:
    assert quantity_bytes("1Gi") == 2**30 and quantity_bytes("512Mi") == 2**29
    assert quantity_bytes("1500M") == 1_500_000_000
    with pytest.raises(ValueError):
        quantity_bytes("lots")
