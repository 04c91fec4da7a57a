"""The rows sweep's fit separates what a request costs from what a batch costs."""

from __future__ import annotations

import pytest

from sluice_inference.bench.rows_sweep import fit


def test_the_fit_recovers_per_request_and_per_batch_costs() -> None:
    rows = [1.2, 2.5, 4.0, 9.0]
    c0, c1 = fit(rows, [0.8 + 1.5 / r for r in rows])
    assert c0 == pytest.approx(0.8) and c1 == pytest.approx(1.5)
