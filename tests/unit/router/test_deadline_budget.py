"""The deadline budget (router/policy/deadline_budget.py): its table is the one docs/admission.md shows, and
each rule answers "when is this request shed, and why" at its boundary."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_inference.common.errors import Code, SluiceError
from sluice_inference.common.serving_settings import AdmissionSettings, RouterSettings
from sluice_inference.router.policy.deadline_budget import (
    BATCHES_AHEAD,
    BUDGET_TABLE,
    MAX_WIRE_BUDGET_US,
    MIN_RESERVE_S,
    RESERVE_FRACTION,
    DeadlineBudget,
)

DOCS = Path(__file__).resolve().parents[3] / "docs" / "admission.md"
BUDGET = DeadlineBudget(default_s=30.0, longest_s=60.0, estimate_margin=1.5)


def test_the_documented_table_is_the_modules_and_names_its_constants() -> None:
    assert BUDGET_TABLE in DOCS.read_text(encoding="utf-8")
    assert f"L = D - {BATCHES_AHEAD}·t(full)·m" in BUDGET_TABLE
    assert f"max({MIN_RESERVE_S * 1000:g} ms, {RESERVE_FRACTION:.0%} of D - A)" in BUDGET_TABLE


def test_the_budget_reads_its_settings() -> None:
    router = RouterSettings(default_timeout_s=5, max_timeout_s=50)
    budget = DeadlineBudget.of(router, AdmissionSettings(estimate_margin=2.0))
    assert (budget.default_s, budget.longest_s, budget.estimate_margin) == (5, 50, 2.0)


def test_an_over_long_timeout_and_an_over_long_transport_deadline_are_clamped_alike() -> None:
    assert BUDGET.deadline(10.0, 3600.0, None) == BUDGET.deadline(10.0, None, 3600.0) == 70.0
    assert BUDGET.deadline(10.0, 3600.0, 2.0) == 12.0  # the earlier budget wins
    assert BUDGET.deadline(10.0, None, None) == 40.0


def refusal(now: float, best: float = 0.1) -> SluiceError | None:
    """Admission's verdict on a 1 s budget given at 0: execution 0.2 s with its margin, 0.3 s of queue."""
    return BUDGET.admission_refusal(
        deadline=1.0, arrival=0.0, now=now, best=best, execution=0.2, wait=0.3, rows=1
    )


def test_admission_refuses_terminally_only_below_the_best_case() -> None:
    terminal = refusal(0.0, best=1.5)
    assert terminal is not None and (terminal.code, terminal.reason) == (
        Code.INVALID_ARGUMENT,
        "deadline_too_short",
    )
    short = refusal(0.9)  # 0.1 s left < 0.2 s of execution: hint the larger of queue and execution
    assert short is not None and (short.code, short.reason, short.retry_after_s) == (
        Code.UNAVAILABLE, "deadline_unmeetable_now", 0.3,
    )  # fmt: skip
    queued = refusal(0.6)  # 0.4 s left < 0.2 + 0.3
    assert queued is not None and (queued.reason, queued.retry_after_s) == ("deadline_unmeetable_now", 0.3)
    assert refusal(0.4) is None  # 0.6 s left covers both
    saturated = BUDGET.admission_refusal(
        deadline=1.0, arrival=0.0, now=0.9, best=1.5, execution=0.2, wait=0.3, rows=1, terminal=False
    )  # the router's own queue may have spent the budget: retryable, hinted like any other
    assert saturated is not None and (saturated.code, saturated.reason) == (
        Code.UNAVAILABLE, "deadline_unmeetable_now",
    )  # fmt: skip


def test_the_latest_start_keeps_two_full_batches_and_a_reserve_unless_only_now_will_do() -> None:
    roomy = BUDGET.latest_start(deadline=10.0, arrival=0.0, now=0.0, full_s=0.5, execution=0.3)
    assert roomy == pytest.approx(10.0 - BATCHES_AHEAD * 0.5 * 1.5 - RESERVE_FRACTION * 10.0)
    tight = BUDGET.latest_start(deadline=1.0, arrival=0.0, now=0.0, full_s=0.5, execution=0.3)
    assert tight == pytest.approx(1.0 - 0.3)
    assert BUDGET.execution(0.2) == pytest.approx(0.3)


def test_a_lane_is_cut_early_by_what_a_full_batch_adds() -> None:
    assert BUDGET.cut_by(5.0, full_s=0.4, one_s=0.1) == pytest.approx(4.7)


def test_the_rules_that_end_a_request_for_lack_of_time() -> None:
    assert BUDGET.expired_on_arrival(1.0, 0.5) is None
    expired = BUDGET.expired_on_arrival(1.0, 1.0)
    assert expired is not None and expired.reason == "expired_on_arrival"
    ahead = BUDGET.shed_in_queue(1.0, 0.5, retry_after_s=0.2)
    assert (ahead.code, ahead.reason, ahead.retry_after_s) == (Code.UNAVAILABLE, "deadline_unmeetable", 0.2)
    passed = BUDGET.shed_in_queue(1.0, 1.0, retry_after_s=0.2)
    assert (passed.code, passed.reason) == (Code.DEADLINE_EXCEEDED, "expired_in_queue")
    assert BUDGET.expired_on_worker().reason == "expired_on_worker"
    assert BUDGET.finished_late(1.0, 1.0) is None  # at the deadline is still in time
    late = BUDGET.finished_late(1.0, 1.000001)
    assert late is not None and (late.code, late.reason) == (Code.DEADLINE_EXCEEDED, "finished_late")


def test_the_wire_budget_is_whole_microseconds_within_an_int64_and_never_zero() -> None:
    assert BUDGET.wire_budget_us(1.25, 1.0) == 250_000
    assert BUDGET.wire_budget_us(1.0, 2.0) == 1
    assert BUDGET.wire_budget_us(1e30, 0.0) == MAX_WIRE_BUDGET_US


def test_the_deadline_is_the_earlier_budget_never_past_the_maximum() -> None:
    budget = DeadlineBudget.of(RouterSettings(default_timeout_s=30, max_timeout_s=60))
    assert budget.deadline(100.0, None, None) == 130.0
    assert budget.deadline(100.0, 5.0, 2.0) == 102.0
    assert budget.deadline(100.0, 5.0, None) == 105.0
    assert budget.deadline(100.0, 3600.0, None) == 160.0  # a longer deadline is cut to the maximum
    assert budget.deadline(100.0, None, 3600.0) == 160.0  # and so is a longer `timeout`: the same rule
    assert budget.deadline(100.0, None, (2**64 - 1) * 1e-6) == 160.0  # clamped before any arithmetic
