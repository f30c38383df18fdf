"""The global document order: a seeded permutation per epoch, dealt to DP ranks by blocks.

Documents are grouped into blocks of ``block_size`` consecutive indices. Each epoch permutes
the blocks with ``(seed, epoch)`` and the documents inside each block with
``(seed, epoch, block)``; DP rank ``r`` of ``n`` takes blocks ``r, r + n, r + 2n, ...`` of the
permuted list. Every document is in exactly one block and every block goes to exactly one
rank, so an epoch covers the corpus once across ranks. Reads stay local (a block is a few
neighbouring record batches) and memory is one integer per block, not per document.
"""

from __future__ import annotations

import numpy as np

from hlat_data.errors import DataError


def num_blocks(num_docs: int, block_size: int) -> int:
    """How many blocks ``num_docs`` documents make (the last one may be short)."""
    return -(-num_docs // block_size)


def block_order(
    num_docs: int, block_size: int, seed: int, epoch: int, shuffle: bool = True
) -> np.ndarray:
    """The block ids of an epoch, in the order they are read."""
    blocks = num_blocks(num_docs, block_size)
    if not shuffle:
        return np.arange(blocks, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(blocks).astype(np.int64)


def block_documents(
    block: int, num_docs: int, block_size: int, seed: int, epoch: int, shuffle: bool = True
) -> np.ndarray:
    """The document ids of one block, in the order they are read in ``epoch``."""
    start = block * block_size
    size = min(block_size, num_docs - start)
    if not shuffle:
        return np.arange(start, start + size, dtype=np.int64)
    return start + np.random.default_rng([seed, epoch, block]).permutation(size).astype(np.int64)


class _Share:
    """Document ids of one rank in one epoch, as consecutive pieces; ``_ends`` holds the
    cumulative piece lengths and ``_piece(k, lo, hi)`` positions ``lo:hi`` of piece ``k``."""

    _ends: np.ndarray

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def documents(self, start: int, stop: int) -> np.ndarray:
        """Document ids at positions ``start:stop`` of this share."""
        stop = min(stop, len(self))
        out = []
        position = start
        while position < stop:
            k = int(np.searchsorted(self._ends, position, side="right"))
            piece_start = int(self._ends[k - 1]) if k else 0
            piece_stop = min(stop, int(self._ends[k]))
            take = self._piece(k, position - piece_start, piece_stop - piece_start)
            out.append(take)
            position += len(take)
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def _piece(self, k: int, lo: int, hi: int) -> np.ndarray:
        raise NotImplementedError


class RankShare(_Share):
    """The documents one DP rank reads in one epoch, with random access by position.

    Note:
        Shares differ by at most one block in length, and more in tokens; ranks cross epoch
        boundaries at slightly different steps, which is harmless because each rank's stream
        is continuous across epochs. A stream that ends (``num_epochs``) therefore ends after
        a different number of batches on each rank.
    """

    def __init__(
        self,
        num_docs: int,
        block_size: int,
        seed: int,
        epoch: int,
        dp_rank: int,
        dp_size: int,
        shuffle: bool = True,
    ) -> None:
        check_layout(num_docs, block_size, dp_rank, dp_size)
        self.num_docs, self.block_size, self.seed, self.epoch = num_docs, block_size, seed, epoch
        self.shuffle = shuffle
        self.blocks = block_order(num_docs, block_size, seed, epoch, shuffle)[dp_rank::dp_size]
        sizes = np.minimum(block_size, num_docs - self.blocks * block_size)
        self._ends = np.cumsum(sizes)
        self._cached: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def _piece(self, k: int, lo: int, hi: int) -> np.ndarray:
        return self._block(k)[lo:hi]

    def _block(self, k: int) -> np.ndarray:
        if self._cached[0] != k:
            docs = block_documents(
                int(self.blocks[k]),
                self.num_docs,
                self.block_size,
                self.seed,
                self.epoch,
                self.shuffle,
            )
            self._cached = (k, docs)
        return self._cached[1]


def check_seed(seed: object) -> None:
    """Raise a :class:`DataError` unless ``seed`` is an integer of 0 or more (NumPy's
    generators take no other)."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise DataError(f"seed must be an integer of 0 or more, got {seed!r}")


def check_layout(num_docs: int, block_size: int, dp_rank: int, dp_size: int) -> None:
    """Raise a :class:`DataError` unless every DP rank gets at least one block."""
    if block_size < 1:
        raise DataError(f"block_size must be at least 1, got {block_size}")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1} (dp_size {dp_size})")
    blocks = num_blocks(num_docs, block_size)
    if blocks < dp_size:
        raise DataError(
            f"{num_docs} documents make {blocks} block(s) of block_size {block_size}, fewer than "
            f"dp_size {dp_size}, so some ranks would get no data; lower block_size to at most "
            f"{max(1, num_docs // dp_size)} or add documents"
        )


class ResumedShare(_Share):
    """The rest of an epoch, dealt anew after a resume with a different ``dp_size``.

    ``cursors`` are the old ranks' ``(epoch, position, offset)``. Of this epoch, every old
    rank still in it leaves the documents after its cursor (a document it had started
    counts as read); those remainders, cut into pieces of ``block_size`` documents in old
    rank order, are dealt round-robin to the new ranks. Old ranks already in a later epoch
    have read all of their share of this one.
    """

    def __init__(
        self,
        num_docs: int,
        block_size: int,
        seed: int,
        epoch: int,
        dp_rank: int,
        dp_size: int,
        cursors: list[tuple[int, int, int]],
        shuffle: bool = True,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1} (dp_size {dp_size})")
        self.epoch = epoch
        self._old: dict[int, RankShare] = {}
        pieces: list[tuple[int, int, int]] = []
        for rank, (old_epoch, position, offset) in enumerate(cursors):
            if old_epoch != epoch:
                continue
            old = RankShare(num_docs, block_size, seed, epoch, rank, len(cursors), shuffle)
            self._old[rank] = old
            start = position + (1 if offset else 0)
            pieces += [
                (rank, s, min(s + block_size, len(old))) for s in range(start, len(old), block_size)
            ]
        self.pieces = pieces[dp_rank::dp_size]
        self._ends = np.cumsum([stop - start for _, start, stop in self.pieces], dtype=np.int64)

    def _piece(self, k: int, lo: int, hi: int) -> np.ndarray:
        rank, begin, _ = self.pieces[k]
        return self._old[rank].documents(begin + lo, begin + hi)
