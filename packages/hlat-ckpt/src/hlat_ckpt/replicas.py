"""Which rank writes a tensor that several ranks hold: one per replica group, chosen before
anything is staged.

``torch.distributed.checkpoint`` already writes a replicated tensor once: its planner keeps
each duplicated write item (same key, same offsets) on one rank's plan. But that happens
after every rank has staged its whole state to host memory for an async save, so under
ZeRO-1 or plain data parallelism (whole parameters on every rank) each rank would copy
every parameter, and the training step would wait for all of it. The same rule applied
to what the ranks gathered anyway (their state's keys) lets each rank stage and hand to
DCP only the items it will write; DCP then finds no duplicates left.

The rule is DCP's: a tensor of the same key at the same global offsets on several ranks is
one item (the same data), written by one of them. The owner is chosen to balance bytes:
items held by one rank count first, then the duplicated ones, largest first, each to the
holder with the fewest bytes so far (the lowest rank on a tie). Every rank computes the
same owners from the same gathered lists, without a further collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

Item = tuple[tuple[int, ...], int]
"""A tensor as the owner rule sees it: the global offsets of the rank's chunk, its bytes."""


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's chunk of ``tensor`` (its local tensor for a DTensor)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def item_of(tensor: torch.Tensor) -> Item:
    """(global offsets of this rank's chunk, bytes of the chunk): zeros for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        return tuple(int(o) for o in offsets), local_nbytes(tensor)
    return (0,) * tensor.dim(), local_nbytes(tensor)


def owners(per_rank: Sequence[Mapping[str, Item]]) -> dict[tuple[str, tuple[int, ...]], int]:
    """The rank that writes each item, from every rank's ``{key: item}`` (pure)."""
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    sizes: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank, items in enumerate(per_rank):
        for key, (offsets, nbytes) in items.items():
            holders.setdefault((key, offsets), []).append(rank)
            sizes[(key, offsets)] = nbytes
    load = [0] * len(per_rank)
    chosen: dict[tuple[str, tuple[int, ...]], int] = {}
    shared = []
    for item, ranks in holders.items():
        if len(ranks) == 1:
            chosen[item] = ranks[0]
            load[ranks[0]] += sizes[item]
        else:
            shared.append(item)
    for item in sorted(shared, key=lambda i: (-sizes[i], i)):
        rank = min(holders[item], key=lambda r: (load[r], r))
        chosen[item] = rank
        load[rank] += sizes[item]
    return chosen


def not_mine(per_rank: Sequence[Mapping[str, Item]], rank: int) -> set[str]:
    """The keys ``rank`` holds but another rank writes."""
    chosen = owners(per_rank)
    return {key for key, (offsets, _) in per_rank[rank].items() if chosen[(key, offsets)] != rank}
