from __future__ import annotations

import numpy as np
import pytest

from hlat_data import DataError
from hlat_data.order import RankShare


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_an_epoch_covers_every_document_exactly_once_across_ranks(dp_size):
    num_docs, block_size = 1003, 16
    seen = np.concatenate(
        [
            RankShare(num_docs, block_size, seed=5, epoch=2, dp_rank=r, dp_size=dp_size).documents(
                0, 10**9
            )
            for r in range(dp_size)
        ]
    )
    assert len(seen) == num_docs
    assert np.array_equal(np.sort(seen), np.arange(num_docs))


def test_order_depends_on_seed_and_epoch_and_nothing_else():
    def share(seed, epoch):
        return RankShare(500, 8, seed=seed, epoch=epoch, dp_rank=0, dp_size=1).documents(0, 500)

    assert np.array_equal(share(1, 0), share(1, 0))
    assert not np.array_equal(share(1, 0), share(1, 1))
    assert not np.array_equal(share(1, 0), share(2, 0))


def test_documents_of_a_block_stay_together():
    docs = RankShare(640, 64, seed=0, epoch=0, dp_rank=0, dp_size=1).documents(0, 640)
    blocks = docs.reshape(10, 64) // 64
    assert (blocks == blocks[:, :1]).all()


def test_random_access_by_position_matches_the_sequential_order():
    share = RankShare(777, 10, seed=3, epoch=1, dp_rank=1, dp_size=3)
    whole = share.documents(0, len(share))
    assert np.array_equal(
        np.concatenate([share.documents(s, s + 7) for s in range(0, len(share), 7)]), whole
    )
    assert np.array_equal(share.documents(95, 133), whole[95:133])


def test_too_few_blocks_for_the_ranks_is_an_error_with_a_remedy():
    with pytest.raises(
        DataError, match=r"10 documents make 1 block.*lower block_size to at most 2"
    ):
        RankShare(10, 16, seed=0, epoch=0, dp_rank=0, dp_size=4)


def test_rank_outside_the_layout_is_an_error():
    with pytest.raises(DataError, match=r"dp_rank 4 is outside 0..3"):
        RankShare(100, 4, seed=0, epoch=0, dp_rank=4, dp_size=4)
