"""Which model version a call is served by (router/policy/versions.py) and how the catalog names what it
does not know: the newest version an accepting worker serves when the call names none, the named one
otherwise, and a name that matched nothing repeated only in part."""

from __future__ import annotations

import pytest

from sluice_inference.common.errors import Code, SluiceError
from sluice_inference.common.records import ModelRecord, TensorSpec, WorkerRecord
from sluice_inference.router.policy.catalog import ModelCatalog
from sluice_inference.router.policy.versions import version_to_serve
from tests.unit.router.core_support import make_core


def _record(version: str) -> ModelRecord:
    spec = TensorSpec(name="x", datatype="FP32", dims=(4,))
    return ModelRecord(name="m", version=version, digest="d", platform="synthetic", max_batch_size=4,
                       max_wait_s=0.0, inputs=(spec,), outputs=(spec,))  # fmt: skip


def test_without_a_version_the_newest_one_a_worker_accepts_batches_for_is_served() -> None:
    core = make_core()
    catalog = ModelCatalog()
    worker = WorkerRecord(worker_id="w1", addr="a:1", device="cpu", models=(_record("1"), _record("2")),
                          capacity=2, state="ready", started_at=0.0)  # fmt: skip
    catalog.update({"w1": worker})
    core.worker_registered(
        0.0, "w1", {("m", "1"): {}}, 2, True, device="cuda"
    )  # only version 1 is connected here
    core.worker_connected(0.0, "w1", True)
    assert version_to_serve(catalog, "m", "", core.serves).version == "1"
    core.worker_registered(0.0, "w2", {("m", "2"): {}}, 2, True, device="cuda")
    core.worker_connected(0.0, "w2", True)
    assert version_to_serve(catalog, "m", "", core.serves).version == "2"
    assert version_to_serve(catalog, "m", "1", core.serves).version == "1"


def test_a_name_that_matched_nothing_is_repeated_only_in_part() -> None:
    catalog = ModelCatalog()
    worker = WorkerRecord(worker_id="w1", addr="a:1", device="cpu", models=(_record("1"),), capacity=2,
                          state="ready", started_at=0.0)  # fmt: skip
    catalog.update({"w1": worker})
    for name, version in (("x" * 100_000, ""), ("m", "9" * 100_000)):
        with pytest.raises(SluiceError) as caught:
            catalog.resolve(name, version)
        assert caught.value.code == Code.NOT_FOUND and len(caught.value.message) < 400
