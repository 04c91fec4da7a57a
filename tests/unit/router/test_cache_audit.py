"""Cache audit rules on their own (router/policy/cache_audit.py): how two results differ, the tolerance a
model version earns from its measured batch-vs-single deviation, the per-tenant audit budget, and strikes.
Time and random draws are plain numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sluice_inference.router.calls import Tensor
from sluice_inference.router.policy.cache_audit import (
    MAX_RELATIVE_DEVIATION,
    AuditBudget,
    DeviationBook,
    Strikes,
    difference,
)

EPS32 = float(np.finfo(np.float32).eps)


def out(values: list[float], name: str = "y", datatype: str = "FP32") -> Tensor:
    array = np.asarray([values], {"FP32": "<f4", "FP64": "<f8", "INT64": "<i8"}[datatype])
    return Tensor(name, datatype, array.shape, array.tobytes())


# ---------------------------------------------------------------- how two results differ


def test_identical_results_are_exact() -> None:
    gap = difference([out([1.0, 2.0])], [out([1.0, 2.0])])
    assert gap.exact and gap.relative == 0 and gap.within(0.0, 0.0)


def test_a_float_gap_is_measured_relative_to_the_fresh_outputs_magnitude() -> None:
    gap = difference([out([1000.0, 2.0])], [out([1000.0625, 2.0])])
    assert gap.comparable and not gap.exact
    assert gap.relative == pytest.approx(0.0625 / 1000.0625)
    assert gap.epsilon == EPS32
    assert gap.within(1e-4, 0.0) and not gap.within(1e-5, 0.0)
    assert gap.within(0.0, 0.07)  # the absolute floor alone


@pytest.mark.parametrize(
    ("cached", "fresh"),
    [
        ([out([1.0])], [out([1.0], name="z")]),  # another output
        ([out([1.0])], [out([1.0, 1.0])]),  # another shape
        ([out([1.0], datatype="FP64")], [out([1.0])]),  # another datatype
        ([out([1.0], datatype="INT64")], [out([2.0], datatype="INT64")]),  # integers must be equal
        ([out([math.nan])], [out([1.0])]),  # a NaN only one side has
        ([out([math.inf])], [out([-math.inf])]),  # infinities of another sign
    ],
)
def test_results_that_differ_in_more_than_float_rounding_are_not_comparable(
    cached: list[Tensor], fresh: list[Tensor]
) -> None:
    gap = difference(cached, fresh)
    assert not gap.comparable and not gap.within(1.0, 1e9) and gap.relative == math.inf


def test_nans_in_the_same_places_compare_on_the_other_values() -> None:
    gap = difference([out([math.nan, 1.0])], [out([math.nan, 1.0000001])])
    assert gap.comparable and gap.within(1e-6, 0.0)


# ---------------------------------------------------------------- the measured deviation


def test_a_version_never_measured_is_held_to_its_dtypes_epsilon_times_the_margin() -> None:
    book = DeviationBook(margin=8.0)
    assert book.measured("mlp", "1") is None
    assert book.limit("mlp", "1", EPS32) == pytest.approx(8 * EPS32)


def test_a_measurement_raises_only_that_versions_limit_and_never_lowers_it() -> None:
    book = DeviationBook(margin=8.0)
    book.learn("mlp", "1", 1e-6)
    book.learn("mlp", "1", 2e-7)  # a smaller deviation seen later does not shrink what was measured
    assert book.limit("mlp", "1", EPS32) == pytest.approx(8e-6)
    assert book.limit("mlp", "2", EPS32) == pytest.approx(8 * EPS32)


def test_a_measured_deviation_is_capped() -> None:
    book = DeviationBook(margin=8.0)
    assert book.learn("noisy", "1", 0.5) == MAX_RELATIVE_DEVIATION
    assert book.learn("noisy", "1", math.inf) == MAX_RELATIVE_DEVIATION


# ---------------------------------------------------------------- the audit budget


def test_audits_do_not_exceed_each_tenants_rate() -> None:
    budget = AuditBudget(fraction=1.0, rate=1.0, burst=2, max_inflight=1000)
    admitted = sum(budget.admit("gold", 0.0, draw=0.0) for _ in range(100))
    assert admitted == 2  # the burst, however many hits
    admitted = sum(budget.admit("gold", t / 10, draw=0.0) for t in range(1, 101))  # 10 s of hits
    assert admitted == 10  # the rate
    assert budget.admit("silver", 10.0, draw=0.0)  # another tenant has its own budget


def test_audits_are_sampled_and_bounded_in_flight() -> None:
    budget = AuditBudget(fraction=0.25, rate=1e6, burst=10**6, max_inflight=2)
    assert not budget.admit("gold", 0.0, draw=0.25)
    assert budget.admit("gold", 0.0, draw=0.1) and budget.admit("gold", 0.0, draw=0.1)
    assert not budget.admit("gold", 0.0, draw=0.1)  # two running
    budget.finished()
    assert budget.admit("gold", 0.0, draw=0.1)


# ---------------------------------------------------------------- strikes


def test_repeated_mismatches_ban_that_tenant_for_that_model_for_a_while() -> None:
    strikes = Strikes(limit=3, ban_s=100.0)
    assert not strikes.strike("gold", "mlp", 0.0)
    assert not strikes.strike("gold", "mlp", 10.0)
    assert strikes.strike("gold", "mlp", 20.0)
    assert strikes.banned("gold", "mlp", 50.0)
    assert not strikes.banned("silver", "mlp", 50.0) and not strikes.banned("gold", "encoder", 50.0)
    assert strikes.bans(50.0) == [("gold", "mlp")]
    assert not strikes.banned("gold", "mlp", 120.0)


def test_strikes_older_than_the_ban_period_are_forgotten() -> None:
    strikes = Strikes(limit=2, ban_s=100.0)
    assert not strikes.strike("gold", "mlp", 0.0)
    assert not strikes.strike("gold", "mlp", 150.0)
    assert strikes.strike("gold", "mlp", 160.0)
