"""Exact isolation of failing items, its forward and row bounds, and who gets the blame (canary)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import pytest

from sluice_inference.common.errors import Code
from sluice_inference.worker.backends.synthetic import POISON, SyntheticBackend
from sluice_inference.worker.executor import ExecItem, Executor, ItemOutcome, LoadedModel
from sluice_inference.worker.isolation import isolate
from sluice_inference.worker.model_config import ModelConfig
from tests.unit.worker.fakes import CountingBackend, FailingBackend, fake_model, synthetic_config

N = 32
LOG2_N = math.ceil(math.log2(N))


def forward_bound(n: int, k: int) -> int:
    """worker/isolation.py's bound on extra forwards for k bad items in n: 2·Σ_{d<⌈log2 n⌉} min(k, 2^d)
    (at most 2·k·⌈log2 n⌉), and never more than 2n - 2."""
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    by_depth = 2 * sum(min(k, 1 << d) for d in range(depth))
    assert by_depth <= 2 * k * depth
    return min(by_depth, max(0, 2 * n - 2))


def poisonable(max_batch_size: int = N) -> tuple[LoadedModel, CountingBackend]:
    """The synthetic model (y = 2x + 1, zero latency; a row starting with POISON fails its forward),
    counting the rows of every forward."""
    config = synthetic_config("toy", max_batch_size=max_batch_size)
    backend = CountingBackend(SyntheticBackend(ModelConfig.model_validate(config), "cpu"))
    return fake_model(config, backend), backend


def items_with_bad(n: int, bad: Sequence[int]) -> list[ExecItem]:
    return [ExecItem(i, {"x": np.full((1, 4), POISON if i in bad else float(i), "<f4")}) for i in range(n)]


def failed_ids(outcomes: list[ItemOutcome]) -> list[int]:
    return [o.item_id for o in outcomes if o.error is not None]


PLACEMENTS = [
    *([b] for b in (0, 11, 31)),
    [3, 20], [0, 31], [14, 15], [15, 16],
    [0, 1, 2, 3], [1, 9, 17, 25], [28, 29, 30, 31], [4, 5, 20, 27],
    *(sorted(random.Random(seed).sample(range(N), k)) for k in (1, 2, 4) for seed in range(8)),
]  # fmt: skip


@pytest.mark.parametrize("bad", PLACEMENTS, ids=str)
def test_k_bad_items_in_32_fail_exactly_those_within_the_forward_bound(bad: list[int]) -> None:
    model, backend = poisonable()
    outcomes = Executor().run(model, items_with_bad(N, bad))
    assert failed_ids(outcomes) == bad
    for outcome in outcomes:
        if outcome.error is None:
            assert outcome.outputs is not None
            np.testing.assert_array_equal(
                outcome.outputs["y"], np.full((1, 4), 2 * outcome.item_id + 1, "<f4")
            )
        else:
            assert outcome.error.code == Code.INTERNAL and not outcome.worker_fault  # the client's doing
    k = len(bad)
    # The first forward is the batch itself. No canary follows (some items passed): with k = 1 isolation
    # takes exactly 2·log2(32) = 10 extra forwards, the bound, so a canary would exceed it.
    extra = backend.rows[1:]
    assert len(extra) <= forward_bound(N, k)  # 10, 18, 30 for k = 1, 2, 4
    assert sum(extra) <= N * LOG2_N


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 32])
def test_isolate_is_exact_and_bounded_for_every_bad_set(n: int) -> None:
    """The algorithm alone, over many bad sets (every k from 0 to n): exact, and within both bounds."""
    rng = random.Random(n)
    log2 = math.ceil(math.log2(n)) if n > 1 else 0
    for _ in range(200):
        bad = set(rng.sample(range(n), rng.randint(0, n)))
        calls: list[Sequence[int]] = []

        def run(part: Sequence[int], bad: set[int] = bad, calls: list[Sequence[int]] = calls) -> list[bool]:
            calls.append(part)
            return [not bad.intersection(part)] * len(part)

        passed = isolate(list(range(n)), run(list(range(n))), run, lambda outcomes: not outcomes[0])
        assert [i for i in range(n) if not passed[i]] == sorted(bad)
        extra = calls[1:]
        assert len(extra) <= forward_bound(n, len(bad))
        assert sum(len(part) for part in extra) <= n * log2


def test_a_batch_of_only_bad_items_is_blamed_on_the_client() -> None:
    model, backend = poisonable(max_batch_size=8)
    outcomes = Executor().run(model, items_with_bad(8, range(8)))
    assert failed_ids(outcomes) == list(range(8))
    assert not any(o.worker_fault for o in outcomes)
    # Every item failed alone: 1 + (2·8 - 2) forwards, then one canary row that passed.
    assert len(backend.rows) == 1 + 14 + 1 and backend.rows[-1] == 1


def test_a_single_bad_item_alone_is_blamed_on_the_client() -> None:
    model, backend = poisonable()
    [outcome] = Executor().run(model, items_with_bad(1, [0]))
    assert outcome.error is not None and not outcome.worker_fault
    assert backend.rows == [1, 1]  # its forward, then the canary


def test_a_model_that_fails_everything_is_blamed_on_the_worker() -> None:
    model = fake_model(synthetic_config(max_batch_size=8), FailingBackend())
    items = [ExecItem(i, {"x": np.ones((1, 4), np.float32)}) for i in range(4)]
    items.append(ExecItem(4, {"x": np.ones((1, 5), np.float32)}))  # invalid: the client's, whatever happens
    executor = Executor()
    outcomes = executor.run(model, items)
    for outcome in outcomes[:4]:
        assert outcome.error is not None and outcome.error.code == Code.INTERNAL and outcome.worker_fault
        assert "boom" in outcome.error.message and "warm-up input" in outcome.error.message
    assert outcomes[4].error is not None and outcomes[4].error.code == Code.INVALID_ARGUMENT
    assert not outcomes[4].worker_fault
    assert executor.fault is None  # a broken model is not a broken device: the worker stays up
