"""The rule that picks which rank stages and writes a tensor several ranks hold."""

from __future__ import annotations

import torch

from hlat_ckpt.replicas import item_of, not_mine, owners


def test_a_tensor_held_by_one_rank_is_that_ranks_and_shared_ones_balance_the_bytes():
    per_rank = [
        {"a": ((0,), 100), "w1": ((0,), 40), "w2": ((0,), 30), "w3": ((0,), 20)},
        {"b": ((0,), 10), "w1": ((0,), 40), "w2": ((0,), 30), "w3": ((0,), 20)},
    ]
    chosen = owners(per_rank)
    assert chosen[("a", (0,))] == 0 and chosen[("b", (0,))] == 1
    # largest shared first, each to the rank with fewer bytes so far: rank 1 (10) takes w1
    # (50), then w2 (80); rank 0 (100) still has more, so w3 goes to rank 1 too (100)
    assert [chosen[(k, (0,))] for k in ("w1", "w2", "w3")] == [1, 1, 1]
    assert not_mine(per_rank, 0) == {"w1", "w2", "w3"} and not_mine(per_rank, 1) == set()


def test_the_same_key_at_other_offsets_is_another_item():
    # two shards of one tensor: each rank writes its own
    per_rank = [{"w": ((0, 0), 8)}, {"w": ((2, 0), 8)}]
    assert not_mine(per_rank, 0) == not_mine(per_rank, 1) == set()


def test_ties_go_to_the_lowest_rank_and_every_rank_computes_the_same_owners():
    per_rank = [{"w": ((0,), 8)}, {"w": ((0,), 8)}, {"w": ((0,), 8)}]
    assert owners(per_rank) == owners(list(per_rank)) == {("w", (0,)): 0}
    assert [not_mine(per_rank, r) for r in range(3)] == [set(), {"w"}, {"w"}]


def test_a_plain_tensor_is_one_chunk_at_the_origin():
    assert item_of(torch.zeros(3, 5)) == ((0, 0), 60)
