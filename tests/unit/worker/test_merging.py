"""next_forward: which waiting batches run together when the device is free."""

from __future__ import annotations

from sluice_inference.worker.merging import RUNS_ALONE, Candidate, MergeKey, max_rows, next_forward
from sluice_inference.worker.model_config import ModelConfig

KEY = MergeKey("m", "1", (), ((4,),))


def waiting(key: MergeKey | None, rows: int, max_rows: int = 8) -> Candidate:
    return Candidate(key, rows, max_rows)


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


def test_first_fit_within_max_batch_size() -> None:
    # 5 + 4 would exceed 8; the later batch of 3 still fits.
    assert next_forward([waiting(KEY, 5), waiting(KEY, 4), waiting(KEY, 3)]) == [0, 2]


def test_the_cost_cap_limits_rows_as_routers_cut_batches() -> None:
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
    assert max_rows(config, ((16,),)) == 16  # 16 rows x 16 = 256
    assert max_rows(config, ((256,),)) == 1  # one long row is the whole budget: long batches never merge
    no_cap = config.batching.model_copy(update={"max_batch_cost": None})
    uncapped = config.model_copy(update={"batching": no_cap})
    assert max_rows(uncapped, ((256,),)) == 16
