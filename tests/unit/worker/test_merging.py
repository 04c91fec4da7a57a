"""next_forward: which waiting batches run together when the device is free."""

from __future__ import annotations

from worker.merging import RUNS_ALONE, Candidate, MergeKey, next_forward

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
