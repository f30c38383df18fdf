"""Packing: a continuous token stream cut into exact rows with next-token labels.

Documents (each ``[BOS] ids EOS``) are concatenated into one stream per DP rank. Row ``k``
takes stream tokens ``k*S .. k*S+S-1`` as inputs and ``k*S+1 .. k*S+S`` as labels, so
consecutive rows share one token (the last label of a row is the first input of the next)
and no token is dropped or repeated. ``position_ids`` restart at 0 at every document start
*and* at every row start: a document cut by a row boundary continues in the next row with
positions 0, 1, ... (the row cannot attend to the previous row anyway). ``doc_lens`` lists
the lengths of these segments per row, zero padded, as hlat-model's document masking takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

IGNORE_INDEX = -100
"""Label of positions that carry no next token (padding of a final partial batch)."""


class Batch(NamedTuple):
    """One micro-batch of packed rows, as int64 NumPy arrays.

    Attributes:
        input_ids: [B, S] token ids.
        labels: [B, S] the next token of each input (``-100`` only in the padding of a
            final partial batch).
        position_ids: [B, S] positions restarting at each document and each row.
        doc_lens: [B, D] lengths of the row's document segments, zero padded; each row's
            lengths sum to S (less in a final partial batch, where padding follows).
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    doc_lens: np.ndarray


@dataclass
class Chunk:
    """Tokens of consecutive documents of one rank's share, as the packer receives them.

    ``lens`` has one entry per document (0 for an empty one). After a resume, the first
    ``skip`` tokens of the first document were already emitted: they are neither in
    ``tokens`` nor counted in ``lens[0]``. ``bad`` of the documents were bad records the
    source read as empty.
    """

    epoch: int
    start: int
    tokens: np.ndarray
    lens: np.ndarray
    skip: int = 0
    bad: int = 0


@dataclass
class _Placed:
    chunk: Chunk
    begin: int  # absolute stream position of chunk.tokens[0]
    ends: np.ndarray  # absolute stream position where each document ends


class Packer:
    """Turns :class:`Chunk` s into :class:`Batch` es of ``micro_batch_size`` rows of
    ``seq_len`` tokens, and reports the stream position of the next unread input token."""

    def __init__(self, seq_len: int, micro_batch_size: int, pad_id: int = 0) -> None:
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.pad_id = pad_id
        self._tokens = np.empty(0, dtype=np.int64)
        self._head = 0  # absolute position of self._tokens[0] and of the next input token
        self._placed: list[_Placed] = []

    @property
    def buffered(self) -> int:
        """Tokens received but not yet emitted as inputs."""
        return len(self._tokens)

    def push(self, chunk: Chunk) -> None:
        """Append a chunk's tokens to the stream."""
        begin = self._head + len(self._tokens)
        ends = begin + np.cumsum(chunk.lens)
        self._placed.append(_Placed(chunk, begin, ends))
        self._tokens = np.concatenate([self._tokens, chunk.tokens.astype(np.int64, copy=False)])

    def ready(self) -> bool:
        """Whether a full batch (B*S inputs plus one label) is buffered."""
        return len(self._tokens) >= self.micro_batch_size * self.seq_len + 1

    def pop(self) -> Batch:
        """The next full batch; call only when :meth:`ready`."""
        n = self.micro_batch_size * self.seq_len
        return self._emit(self._tokens[: n + 1], n)

    def pop_partial(self) -> Batch | None:
        """What is left as a final batch padded to full shape, or None when nothing is left.

        Padding tokens are ``pad_id`` with label ``-100``; they lie past ``doc_lens.sum(-1)``.
        A single token left has no next token to predict: it is consumed, and None returned.
        """
        n = self.micro_batch_size * self.seq_len
        available = min(len(self._tokens), n + 1)  # counted before _emit consumes them
        real = min(available, n)
        if real <= 1:
            self._advance(real)
            return None
        stream = np.full(n + 1, self.pad_id, dtype=np.int64)
        stream[:available] = self._tokens[:available]
        batch = self._emit(stream, real)
        labels = batch.labels.reshape(-1)
        labels[available - 1 :] = IGNORE_INDEX
        return batch

    def cursor(self) -> tuple[int, int, int] | None:
        """(epoch, share position, token offset) of the document holding the next input
        token; None when the buffer is empty and no chunk says where the stream goes on."""
        for placed in self._placed:
            k = int(np.searchsorted(placed.ends, self._head, side="right"))
            if k < len(placed.ends):
                doc_begin = placed.ends[k - 1] if k else placed.begin - placed.chunk.skip
                return placed.chunk.epoch, placed.chunk.start + k, int(self._head - doc_begin)
        if self._placed:
            last = self._placed[-1].chunk
            return last.epoch, last.start + len(last.lens), 0
        return None

    def _emit(self, stream: np.ndarray, real: int) -> Batch:
        b, s = self.micro_batch_size, self.seq_len
        n = b * s
        is_start = np.zeros(n, dtype=bool)
        is_start[::s] = True
        ends = self._doc_ends()
        inner = ends[(ends > self._head) & (ends < self._head + real)] - self._head
        is_start[inner] = True
        if real < n:
            is_start[real] = True  # padding forms its own trailing segment
        index = np.arange(n)
        positions = index - np.maximum.accumulate(np.where(is_start, index, 0))
        starts = np.flatnonzero(is_start)
        lengths = np.diff(np.append(starts, n))
        if real < n:  # padding is not a document
            keep = starts < real
            starts, lengths = starts[keep], lengths[keep]
        rows = starts // s
        counts = np.bincount(rows, minlength=b)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        doc_lens = np.zeros((b, max(1, int(counts.max()))), dtype=np.int64)
        doc_lens[rows, np.arange(len(starts)) - first[rows]] = lengths
        batch = Batch(
            input_ids=stream[:n].reshape(b, s).copy(),
            labels=stream[1 : n + 1].reshape(b, s).copy(),
            position_ids=positions.reshape(b, s),
            doc_lens=doc_lens,
        )
        self._advance(min(real, len(self._tokens)))
        return batch

    def _doc_ends(self) -> np.ndarray:
        if not self._placed:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([p.ends for p in self._placed])

    def _advance(self, count: int) -> None:
        self._tokens = self._tokens[count:]
        self._head += count
        # a chunk is done once the head has passed its last token; keep the newest so the
        # cursor can still say where the stream continues
        while (
            len(self._placed) > 1
            and self._placed[0].begin + len(self._placed[0].chunk.tokens) <= self._head
        ):
            self._placed.pop(0)
