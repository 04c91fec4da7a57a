"""The fit of the router's CPU per batch and per row (router/host_cost.py)."""

from __future__ import annotations

import pytest

from sluice_inference.router.host_cost import HostCostFit


def test_recovers_both_costs_from_intervals_of_different_batch_sizes() -> None:
    fit = HostCostFit()
    h, c = 0.0004, 0.0002
    for batches, rows in ((100, 170), (80, 320), (60, 480), (120, 150)):
        estimate = fit.add(h * batches + c * rows, batches, rows)
    assert estimate is not None
    assert estimate.batch_s == pytest.approx(h, rel=1e-6)
    assert estimate.row_s == pytest.approx(c, rel=1e-6)


def test_a_steady_batch_size_gives_no_split_and_keeps_the_last_one() -> None:
    fit = HostCostFit()
    for _ in range(5):
        assert fit.add(0.1, 100, 170) is None  # rows per batch never vary: h and c cannot be told apart
    for batches, rows in ((100, 170), (50, 400), (80, 160)):
        fit.add(0.0004 * batches + 0.0002 * rows, batches, rows)
    before = fit.estimate
    assert before is not None
    fit.add(0.1, 0, 0)  # an idle interval says nothing
    assert fit.estimate == before


def test_costs_never_come_out_negative() -> None:
    fit = HostCostFit()
    for batches, rows in ((100, 100), (50, 400), (80, 800)):
        estimate = fit.add(0.00025 * rows - 0.00001 * batches, batches, rows)
    assert estimate is not None
    assert estimate.batch_s == 0.0 and estimate.row_s > 0.0
