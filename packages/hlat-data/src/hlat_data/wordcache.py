"""A cache of SentencePiece BPE encodings of pieces of text, exact by construction.

Text repeats its words, so a tokenizer that remembers what each word encodes to does most of
a corpus with dictionary look-ups (Hugging Face `tokenizers` and tiktoken keep such caches
too). SentencePiece has none; this module adds one in front of it, for the models where the
result is provably the same as encoding the whole text:

- BPE merges adjacent symbols only into pieces of the vocabulary. So no merge ever spans
  the point between two characters that no piece holds side by side. Cut at such points,
  the text falls into parts that BPE encodes independently: merges in one part never
  depend on another, and within a part they happen in the same order as in the whole text
  (highest score first, ties to the left).
- Two kinds of points qualify. Before a space that follows a non-space, when no piece has a
  whitespace symbol ``▁`` after any other character (true of every model trained with
  ``split_by_whitespace``, SentencePiece's default) and ``▁`` is a piece of its own or
  byte fallback is on; this gives *words* (a run of spaces, then a run of non-spaces).
  And, within words, between two ASCII characters that no piece holds side by side and
  that are pieces of their own (:func:`ascii_cuts`): in code, ``self.assertEqual(x,``
  falls into ``self``, ``.``, ``assertEqual``, ``(``, ``x``, ``,`` when the vocabulary
  joins none of those neighbours. Without byte fallback SentencePiece folds a run of
  unknown pieces into one, so no cut may fall inside such a run: a character the
  vocabulary lacks is never cut from its neighbour, and a space (``▁``) that is no piece
  would be unknown too, joining the unknown character before it.
- A user-defined piece is matched whole, left to right, before BPE runs, and is never
  merged further; a cut never falls inside one, since each of its neighbouring pairs is
  held by a piece (itself).
- The text the model encodes is the normalized text. With an identity normalizer (no
  character map, no rules), no whitespace collapsing and whitespace escaping on, it is the
  input with each space replaced by ``▁`` and, with ``add_dummy_prefix``, one more ``▁`` in
  front. So a part of the input encodes, alone, to what it encodes to inside the text, by a
  processor whose dummy prefix is turned off; the text's own dummy prefix is a space put in
  front of it. The same holds for any two parts of a text cut before a space that follows
  a non-space: the part after the cut, encoded without a dummy prefix, gives the ids it
  has in the whole text. Long documents are cut there (``Tokenizer.encode_documents``).

:func:`cache_blocker` checks those conditions on a model (its vocabulary and normalizer
spec); :class:`WordCache` cuts texts into parts, looks them up, and encodes the parts it has
not seen in batch calls to SentencePiece. Llama-2's and Llama-style tokenizers
(``train_tokenizer``) qualify; unigram models do not (Viterbi scores are sums of floats, so
a word's best path need not be the same alone and in context).
"""

from __future__ import annotations

import operator
import re
from array import array
from collections.abc import Callable, Iterator
from functools import lru_cache, partial
from itertools import islice
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "WordCache",
    "adds_dummy_prefix",
    "ascii_cuts",
    "cache_blocker",
    "normalizes",
    "prenormalized",
    "user_defined_symbols",
    "without_dummy_prefix",
]

_SPACE = "\u2581"  # SentencePiece's whitespace symbol
_PIECE_OK = re.compile(f"{_SPACE}*[^{_SPACE}]*\\Z")
_BPE = 2  # TrainerSpec.ModelType
_ENCODE_SLICE = 512  # new words per SentencePiece call
_is_none = partial(operator.is_, None)

# ModelProto field numbers (sentencepiece_model.proto)
_PIECES, _TRAINER_SPEC, _NORMALIZER_SPEC = 1, 2, 3
_PIECE_TYPE, _USER_DEFINED = 3, 4  # SentencePiece.type, Type.USER_DEFINED
_USER_DEFINED_TAIL = bytes([_PIECE_TYPE << 3, _USER_DEFINED])
_MODEL_TYPE, _TREAT_WS_AS_SUFFIX, _BYTE_FALLBACK = 3, 24, 35
_CHARSMAP, _ADD_DUMMY_PREFIX, _REMOVE_EXTRA_WS, _ESCAPE_WS, _RULE_TSV = 2, 3, 4, 5, 6


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    byte = data[pos]
    if byte < 0x80:
        return byte, pos + 1
    value, shift = byte & 0x7F, 7
    while True:
        pos += 1
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos + 1
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field of a serialized protobuf message, in order."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, value
        elif wire == 2:
            size, pos = _varint(data, pos)
            yield number, data[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            yield number, data[pos : pos + size]
            pos += size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


@lru_cache(maxsize=4)
def _specs(model: bytes) -> tuple[dict[int, Any], dict[int, Any], tuple[str, ...]]:
    """The trainer and normalizer specs of a ModelProto, with SentencePiece's defaults for the
    fields read here (a sub-message that occurs twice merges, the last value winning), and
    its user-defined pieces; read in one pass over the file (kept for the last few files)."""
    trainer: dict[int, Any] = {_MODEL_TYPE: 1, _TREAT_WS_AS_SUFFIX: 0, _BYTE_FALLBACK: 0}
    normalizer: dict[int, Any] = {
        _CHARSMAP: b"",
        _ADD_DUMMY_PREFIX: 1,
        _REMOVE_EXTRA_WS: 1,
        _ESCAPE_WS: 1,
        _RULE_TSV: b"",
    }
    user_defined = []
    for number, value in _fields(model):
        if number == _PIECES and isinstance(value, bytes):
            # the type (field 3) is serialized last; most pieces leave it out or are NORMAL
            if value.endswith(_USER_DEFINED_TAIL):
                piece = dict(_fields(value))
                text = piece.get(1)
                if piece.get(_PIECE_TYPE) == _USER_DEFINED and isinstance(text, bytes):
                    user_defined.append(text.decode())
        elif number == _TRAINER_SPEC and isinstance(value, bytes):
            trainer.update(_fields(value))
        elif number == _NORMALIZER_SPEC and isinstance(value, bytes):
            normalizer.update(_fields(value))
    return trainer, normalizer, tuple(user_defined)


def without_dummy_prefix(model: bytes) -> bytes:
    """``model`` with ``normalizer_spec.add_dummy_prefix = false``.

    Note: a protobuf parser merges a message field that occurs twice, so appending a
    normalizer spec holding only that flag overrides it and keeps everything else; this is
    the edit transformers' ``LlamaTokenizer(legacy=False)`` makes through the protobuf
    classes.
    """
    return model + bytes([_NORMALIZER_SPEC << 3 | 2, 2, _ADD_DUMMY_PREFIX << 3, 0])


def normalizes(model: bytes) -> bool:
    """Whether the model's normalizer changes the text before BPE (maps characters, e.g.
    ``nmt_nfkc``, or collapses whitespace)."""
    normalizer = _specs(model)[1]
    return bool(normalizer[_CHARSMAP] or normalizer[_RULE_TSV] or normalizer[_REMOVE_EXTRA_WS])


def prenormalized(model: bytes) -> bytes:
    """``model`` with an identity normalizer that keeps whitespace as given: for text its
    own normalizer has already normalized (``SentencePieceProcessor.normalize``, with the
    ``▁`` it writes turned back into spaces and the dummy prefix dropped), it encodes to the
    ids ``model`` gives the raw text, and the word cache's conditions can hold for it.

    Note: appended as a second normalizer spec (name ``identity``, no character map or
    rules, no whitespace collapsing), which a protobuf parser merges over the first, as in
    :func:`without_dummy_prefix`.
    """
    spec = b"\x0a\x08identity" + bytes(
        [_CHARSMAP << 3 | 2, 0, _REMOVE_EXTRA_WS << 3, 0, _RULE_TSV << 3 | 2, 0]
    )
    return model + bytes([_NORMALIZER_SPEC << 3 | 2, len(spec)]) + spec


def adds_dummy_prefix(model: bytes) -> bool:
    """Whether the model puts ``▁`` in front of each text it encodes."""
    return bool(_specs(model)[1][_ADD_DUMMY_PREFIX])


def user_defined_symbols(model: bytes) -> list[str]:
    """The model's pieces of type USER_DEFINED (matched whole in the text before BPE runs)."""
    return list(_specs(model)[2])


def cache_blocker(model: bytes, processor: Any) -> str | None:
    """Why a word cache would not reproduce ``processor``'s encoding, or None if it would.

    None also means that a text cut before a space that follows a non-space encodes to its
    first part's ids followed by the second part's, encoded without a dummy prefix."""
    try:
        trainer, normalizer, _ = _specs(model)
    except (ValueError, IndexError) as e:
        return f"the model file could not be read ({e})"
    if trainer[_MODEL_TYPE] != _BPE:
        return "not a BPE model"
    if trainer[_TREAT_WS_AS_SUFFIX]:
        return "whitespace is treated as a suffix"
    if normalizer[_CHARSMAP] or normalizer[_RULE_TSV]:
        return "the normalizer maps characters (only identity normalization is cached)"
    if normalizer[_REMOVE_EXTRA_WS]:
        return "the normalizer collapses whitespace"
    if not normalizer[_ESCAPE_WS]:
        return "the normalizer does not escape whitespace"
    merged = _merged_pieces(processor)
    for i, piece in merged:
        if not _PIECE_OK.match(piece):
            return f"piece {i} ({piece!r}) has whitespace after other characters"
    if not trainer[_BYTE_FALLBACK] and not any(
        piece == _SPACE and not processor.is_unused(i) for i, piece in merged
    ):
        return (
            f"the vocabulary has no piece {_SPACE!r} and no byte fallback (a space after an "
            "unknown character would join its unknown piece)"
        )
    return None


def ascii_cuts(processor: Any) -> np.ndarray:
    """Where BPE never merges between two ASCII characters, as a table of byte pairs.

    Entry ``a * 256 + b`` is True when no piece of the vocabulary holds character ``a``
    followed by ``b`` (``▁`` read as a space) and both are pieces of their own, so the
    text can also be cut between them. Only ASCII pairs are entered, the bytes of other
    characters never are.

    Note: requiring both characters to be pieces keeps each cut off a run of characters the
    vocabulary lacks: SentencePiece folds such a run into one unknown piece (without byte
    fallback), which a cut would split in two.
    """
    pieces = _merged_pieces(processor)
    utf8 = [piece.replace(_SPACE, " ").encode() for _, piece in pieces]
    known = np.zeros(128, dtype=bool)
    singles = [
        u[0]
        for (i, _), u in zip(pieces, utf8, strict=True)
        if len(u) == 1 and not processor.is_unused(i)
    ]
    known[singles] = True
    data = np.frombuffer(b"".join(utf8), dtype=np.uint8).astype(np.intp)
    # pairs of neighbouring bytes within a piece (a piece's last byte has no partner)
    within = np.ones(max(len(data) - 1, 0), dtype=bool)
    within[np.cumsum(np.fromiter(map(len, utf8), np.intp, count=len(utf8)))[:-1] - 1] = False
    ascii_pair = within & (data[:-1] < 128) & (data[1:] < 128)
    inside = np.zeros((128, 128), dtype=bool)  # pairs some piece holds
    inside[data[:-1][ascii_pair], data[1:][ascii_pair]] = True
    table = np.zeros((256, 256), dtype=bool)
    table[:128, :128] = known[:, None] & known[None, :] & ~inside
    return table.reshape(-1)


def _merged_pieces(processor: Any) -> list[tuple[int, str]]:
    """(id, piece) of each piece BPE can produce by merging: all but the control, unknown and
    byte-fallback pieces."""
    pieces = processor.id_to_piece(list(range(processor.get_piece_size())))
    return [
        (i, piece)
        for i, piece in enumerate(pieces)
        if not (processor.is_control(i) or processor.is_unknown(i) or processor.is_byte(i))
    ]


class WordCache:
    """Encodes texts part by part through a bounded dictionary of the parts' encodings.

    The parts are words (cut before each space that follows a non-space), cut further where
    ``cuts`` allows; "word" below means such a part.

    Args:
        dummy_prefix: whether the model puts ``▁`` in front of each text.
        capacity: words kept at most; when full, the older half is dropped.
        cuts: where else words may be cut, from :func:`ascii_cuts`; None: nowhere else.
        max_word_chars: longer words are encoded every time, never kept (they rarely repeat).

    Attributes:
        misses: words that had to be encoded; hits: word occurrences that did not.
    """

    def __init__(
        self,
        *,
        dummy_prefix: bool,
        capacity: int,
        cuts: np.ndarray | None = None,
        max_word_chars: int = 64,
    ) -> None:
        self._prefix = " " if dummy_prefix else ""
        self._cuts = cuts
        self.capacity = capacity
        self.max_word_chars = max_word_chars
        self._words: dict[str, bytes] = {}
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._words)

    def empty_copy(self) -> WordCache:
        """A cache with the same settings and no words."""
        return WordCache(
            dummy_prefix=bool(self._prefix),
            capacity=self.capacity,
            cuts=self._cuts,
            max_word_chars=self.max_word_chars,
        )

    def encode_flat(
        self,
        texts: list[str],
        encode: Callable[[list[str]], list[list[int]]],
        continued: list[bool] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ids of all ``texts`` concatenated (int32) and each text's number of ids.

        ``encode`` encodes a list of words (each alone, with no dummy prefix) to lists of ids.
        ``continued`` marks the texts that continue the text before them (each starts with a
        space after a non-space there): they get no dummy prefix, and encode to their ids in
        the joined text.
        """
        if not texts:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        # Note: the words are found, and told apart, by NumPy and Arrow over the UTF-8 bytes
        # of the batch, so that Python handles each distinct word of a batch once, not each
        # occurrence. ``▁`` becomes a space: SentencePiece escapes a space to it, so both
        # encode alike, and only byte 0x20 (never part of a longer UTF-8 sequence) is then a
        # space. An empty text has no dummy prefix: SentencePiece encodes it to nothing.
        # Arrow arrays are made from buffers and read through buffers: its conversions to
        # and from Python objects import pandas where it is installed (0.2 s a process).
        prefix = self._prefix
        if continued is None:
            utf8 = [(prefix + t.replace(_SPACE, " ")).encode() if t else b"" for t in texts]
        else:
            utf8 = [
                ((t if more else prefix + t) if t else "").replace(_SPACE, " ").encode()
                for t, more in zip(texts, continued, strict=True)
            ]
        text_bounds = np.zeros(len(utf8) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, utf8), np.int64, count=len(utf8)), out=text_bounds[1:])
        data = b"".join(utf8)
        # a word starts at each text's start, at each space after a non-space, and between
        # two ASCII characters no piece joins
        utf8_bytes = np.frombuffer(data, np.uint8)
        space = utf8_bytes == 0x20
        starts = np.zeros(len(data) + 1, dtype=bool)
        starts[1:-1] = space[1:] & ~space[:-1]
        if self._cuts is not None and len(data) > 1:
            pairs = (utf8_bytes[:-1].astype(np.uint16) << 8) | utf8_bytes[1:]
            starts[1:-1] |= self._cuts[pairs]
        starts[text_bounds] = True
        word_bounds = np.flatnonzero(starts)
        words = pa.Array.from_buffers(
            pa.large_string(),
            len(word_bounds) - 1,
            [None, pa.py_buffer(word_bounds), pa.py_buffer(data)],
        )
        owners = np.searchsorted(text_bounds, word_bounds[:-1], side="right") - 1
        distinct = pc.dictionary_encode(words)
        indices = distinct.indices
        which = np.frombuffer(indices.buffers()[1], np.int32, len(indices), indices.offset)
        keys = distinct.dictionary.to_pylist()
        values = np.fromiter(map(self._words.get, keys), dtype=object, count=len(keys))
        missing = np.flatnonzero(np.fromiter(map(_is_none, values), bool, count=len(values)))
        new = [keys[i] for i in missing.tolist()]
        self.misses += len(new)
        self.hits += len(words) - len(new)
        # Note: new words are encoded a slice at a time: SentencePiece returns a list per
        # word, and a few hundred thousand of them alive at once would set off full garbage
        # collections. The cache is trimmed back to its bounds afterwards.
        for start in range(0, len(new), _ENCODE_SLICE):
            part = new[start : start + _ENCODE_SLICE]
            encoded = [array("i", ids).tobytes() for ids in encode(part)]
            values[missing[start : start + _ENCODE_SLICE]] = encoded
            self._words.update(zip(part, encoded, strict=True))
        if new:
            self._trim(new)
        ids = np.frombuffer(bytearray().join(values[which]), dtype=np.int32)  # writable
        word_lens = np.fromiter(map(len, values), dtype=np.int64, count=len(values)) // 4
        lens = np.bincount(owners, weights=word_lens[which], minlength=len(texts))
        return ids, lens.astype(np.int64)

    def _trim(self, new: list[str]) -> None:
        words, limit = self._words, self.max_word_chars
        for word in new:
            if len(word) > limit:
                del words[word]
        if len(words) > self.capacity:
            # dicts keep insertion order: this drops the words cached first (the frequent
            # ones come back at their next use), down to half the capacity
            for word in list(islice(words, len(words) - self.capacity // 2)):
                del words[word]
