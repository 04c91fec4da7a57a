"""The batching rule (common/batching.py): what fits a batch, and which waiting batches run as one forward;
and a model config's limits and row cost as the worker hands them to it."""

from __future__ import annotations

from sluice_inference.common.batching import RUNS_ALONE, BatchFill, BatchLimits, Candidate, next_forward
from sluice_inference.worker.device_thread import MergeKey
from sluice_inference.worker.model_config import ModelConfig

KEY = MergeKey("m", "1", (), ((4,),))
EIGHT_ROWS = BatchLimits(max_rows=8)


def waiting(key: MergeKey | None, rows: int, cost: int = 0, limits: BatchLimits = EIGHT_ROWS) -> Candidate:
    return Candidate(key, rows, cost, limits)


def test_the_first_member_always_fits_even_over_every_limit() -> None:
    fill = BatchFill(BatchLimits(max_rows=2, max_cost=10, max_bytes=100))
    assert fill.take(5, 50, 500)
    assert (fill.members, fill.rows, fill.cost, fill.bytes) == (1, 5, 50, 500)
    assert not fill.take(0, 0, 0)  # nothing fits beside a first member over the limits
    assert fill.members == 1


def test_each_limit_that_is_set_stops_a_later_member() -> None:
    limits = BatchLimits(max_rows=4, max_cost=10, max_bytes=100)
    for rows, cost, size in ((4, 1, 1), (1, 10, 1), (1, 1, 100)):  # each over one limit with the first
        fill = BatchFill(limits)
        assert fill.take(1, 1, 1)
        assert not fill.take(rows, cost, size)
        assert (fill.members, fill.rows, fill.cost, fill.bytes) == (1, 1, 1, 1)  # a refusal adds nothing
    fill = BatchFill(limits)
    assert fill.take(1, 1, 1) and fill.take(3, 9, 99)  # exactly at every limit fits
    assert not fill.take(0, 0, 1)


def test_unset_cost_and_byte_limits_do_not_limit() -> None:
    fill = BatchFill(BatchLimits(max_rows=3))
    assert all(fill.take(1, 10**9, 10**9) for _ in range(3))
    assert not fill.take(1)


def test_most_rows_is_what_the_rows_and_the_cost_cap_let_through_and_at_least_one() -> None:
    assert BatchLimits(max_rows=16).most_rows(256) == 16
    capped = BatchLimits(max_rows=16, max_cost=256)
    assert [capped.most_rows(cost) for cost in (1, 16, 100, 256, 1000)] == [16, 16, 2, 1, 1]
    for cost in (1, 16, 100, 256, 1000):  # as many as BatchFill takes one by one
        fill = BatchFill(capped)
        assert sum(fill.take(1, cost) for _ in range(40)) == capped.most_rows(cost)


def test_nothing_waiting_runs_nothing() -> None:
    assert next_forward([]) == []


def test_the_oldest_runs_now_and_same_key_batches_join_it_in_arrival_order() -> None:
    assert next_forward([waiting(KEY, 2), waiting(KEY, 3), waiting(KEY, 1)]) == [0, 1, 2]


def test_a_batch_that_merges_with_nothing_runs_alone_even_with_partners_waiting() -> None:
    assert next_forward([RUNS_ALONE, waiting(KEY, 1), waiting(KEY, 1)]) == [0]


def test_model_version_outputs_and_shape_must_all_agree() -> None:
    others = [
        MergeKey("other", "1", (), ((4,),)),
        MergeKey("m", "2", (), ((4,),)),
        MergeKey("m", "1", ("y",), ((4,),)),
        MergeKey("m", "1", (), ((8,),)),
        None,
    ]
    assert next_forward([waiting(KEY, 1), *(waiting(k, 1) for k in others), waiting(KEY, 1)]) == [0, 6]


def test_first_fit_within_the_rows() -> None:
    # 5 + 4 would exceed 8; the later batch of 3 still fits.
    assert next_forward([waiting(KEY, 5), waiting(KEY, 4), waiting(KEY, 3)]) == [0, 2]


def test_first_fit_within_the_cost_cap_of_the_oldest_batch() -> None:
    capped = BatchLimits(max_rows=8, max_cost=32)
    batches = [waiting(KEY, 1, 16, capped), waiting(KEY, 2, 32, capped), waiting(KEY, 1, 16, capped)]
    assert next_forward(batches) == [0, 2]  # 16 + 32 is over the cap; 16 + 16 is at it
    assert next_forward([waiting(KEY, 1, 40, capped), waiting(KEY, 1, 1, capped)]) == [0]  # over alone


def test_a_model_config_gives_its_limits_and_the_cost_of_a_padded_row() -> None:
    config = ModelConfig.model_validate(
        {
            "name": "seq",
            "backend": "synthetic",
            "inputs": [{"name": "x", "datatype": "FP32", "dims": [-1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "dims": [4]}],
            "max_batch_size": 16,
            "batching": {"buckets": {"x": [16, 256]}, "max_batch_cost": 256},
            "synthetic": {"base_ms": 0, "per_item_ms": 0},
        }
    )
    assert config.batch_limits == BatchLimits(max_rows=16, max_cost=256)
    assert config.row_cost_of(((16,),)) == 16 and config.row_cost_of(((256,),)) == 256
    short, long = (Candidate(KEY, 1, config.row_cost_of(((n,),)), config.batch_limits) for n in (16, 256))
    assert next_forward([short] * 17) == list(range(16))  # 16 rows x 16 = 256: rows and cost both full
    assert next_forward([long, long]) == [0]  # one long row is the whole budget: long batches never merge
