"""The keep-last / keep-every rule on one lineage's commits (which commits count: see
test_lineage.py)."""

import pytest

from hlat_ckpt.retention import incomplete_to_delete, steps_to_delete


def test_keeps_the_last_k_complete_checkpoints():
    assert steps_to_delete([10, 20, 30, 40], committed=40, keep_last=2) == [10, 20]


def test_keeps_every_mth_step_permanently():
    assert steps_to_delete(range(100, 1100, 100), 1000, keep_last=2, keep_every=500) == [
        100,
        200,
        300,
        400,
        600,
        700,
        800,
    ]


def test_keep_all_when_keep_last_is_none():
    assert steps_to_delete([1, 2, 3], committed=3, keep_last=None) == []


def test_only_leftovers_older_than_the_commit_are_deleted():
    assert incomplete_to_delete([5, 15, 25], committed=20) == [5, 15]


def test_invalid_keep_last_is_refused():
    with pytest.raises(ValueError, match="keep_last"):
        steps_to_delete([1], committed=1, keep_last=0)
