"""A cache of SentencePiece BPE encodings of whitespace-delimited words, exact by construction.

Text repeats its words, so a tokenizer that remembers what each word encodes to does most of
a corpus with dictionary look-ups (Hugging Face `tokenizers` and tiktoken keep such caches
too). SentencePiece has none; this module adds one in front of it, for the models where the
result is provably the same as encoding the whole text:

- BPE merges adjacent symbols only into pieces of the vocabulary. If no piece has a
  whitespace symbol ``▁`` after any other character (true of every model trained with
  ``split_by_whitespace``, SentencePiece's default), no piece can span the point just
  before a space that follows a non-space. Cut there, the text falls into *words* (a run of
  spaces, then a run of non-spaces) that BPE encodes independently: merges in one word
  never depend on another, and within a word they happen in the same order as in the whole
  text (highest score first, ties to the left).
- The text the model encodes is the normalized text. With an identity normalizer (no
  character map, no rules), no whitespace collapsing and whitespace escaping on, it is the
  input with each space replaced by ``▁`` and, with ``add_dummy_prefix``, one more ``▁`` in
  front. So a word of the input encodes, alone, to what it encodes to inside the text, by a
  processor whose dummy prefix is turned off; the text's own dummy prefix is a space put in
  front of it.

:func:`cache_blocker` checks those conditions on a model (its vocabulary and normalizer
spec); :class:`WordCache` splits, looks up, and encodes the words it has not seen in one
batch call to SentencePiece. Llama-2's and Llama-style tokenizers (``train_tokenizer``)
qualify; unigram models do not (Viterbi scores are sums of floats, so a word's best path
need not be the same alone and in context).
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import numpy as np

__all__ = ["WordCache", "adds_dummy_prefix", "cache_blocker", "without_dummy_prefix"]

_SPACE = "\u2581"  # SentencePiece's whitespace symbol
# A word: a run of spaces (escaped or not) then a run of other characters; or trailing spaces.
_WORDS = re.compile(f"[ {_SPACE}]*[^ {_SPACE}]+|[ {_SPACE}]+\\Z")
_PIECE_OK = re.compile(f"{_SPACE}*[^{_SPACE}]*\\Z")
_BPE = 2  # TrainerSpec.ModelType
_ENCODE_SLICE = 512  # new words per SentencePiece call

# ModelProto field numbers (sentencepiece_model.proto)
_TRAINER_SPEC, _NORMALIZER_SPEC = 2, 3
_MODEL_TYPE, _TREAT_WS_AS_SUFFIX = 3, 24
_CHARSMAP, _ADD_DUMMY_PREFIX, _REMOVE_EXTRA_WS, _ESCAPE_WS, _RULE_TSV = 2, 3, 4, 5, 6


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field of a serialized protobuf message, in order."""
    pos, end = 0, len(data)

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    while pos < end:
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, varint()
        elif wire == 2:
            size = varint()
            yield number, data[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            yield number, data[pos : pos + size]
            pos += size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _spec(model: bytes, field: int, defaults: dict[int, Any]) -> dict[int, Any]:
    """Fields of a sub-message of the ModelProto; repeated occurrences merge, last wins."""
    out = dict(defaults)
    for number, value in _fields(model):
        if number == field and isinstance(value, bytes):
            out.update(_fields(value))
    return out


def without_dummy_prefix(model: bytes) -> bytes:
    """``model`` with ``normalizer_spec.add_dummy_prefix = false``.

    Note: a protobuf parser merges a message field that occurs twice, so appending a
    normalizer spec holding only that flag overrides it and keeps everything else; this is
    the edit transformers' ``LlamaTokenizer(legacy=False)`` makes through the protobuf
    classes.
    """
    return model + bytes([_NORMALIZER_SPEC << 3 | 2, 2, _ADD_DUMMY_PREFIX << 3, 0])


def adds_dummy_prefix(model: bytes) -> bool:
    """Whether the model puts ``▁`` in front of each text it encodes."""
    return bool(_spec(model, _NORMALIZER_SPEC, {_ADD_DUMMY_PREFIX: 1})[_ADD_DUMMY_PREFIX])


def cache_blocker(model: bytes, processor: Any) -> str | None:
    """Why a word cache would not reproduce ``processor``'s encoding, or None if it would."""
    try:
        trainer = _spec(model, _TRAINER_SPEC, {_MODEL_TYPE: 1, _TREAT_WS_AS_SUFFIX: 0})
        normalizer = _spec(
            model,
            _NORMALIZER_SPEC,
            {_CHARSMAP: b"", _REMOVE_EXTRA_WS: 1, _ESCAPE_WS: 1, _RULE_TSV: b""},
        )
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
    for i in range(processor.get_piece_size()):
        if processor.is_control(i) or processor.is_unknown(i) or processor.is_byte(i):
            continue
        piece = processor.id_to_piece(i)
        if not _PIECE_OK.match(piece):
            return f"piece {i} ({piece!r}) has whitespace after other characters"
    return None


class WordCache:
    """Encodes texts word by word through a bounded dictionary of word encodings.

    Args:
        dummy_prefix: whether the model puts ``▁`` in front of each text.
        capacity: words kept at most; when full, the older half is dropped.
        max_word_chars: longer words are encoded every time, never kept (they rarely repeat).

    Attributes:
        misses: words that had to be encoded; hits: word occurrences that did not.
    """

    def __init__(self, *, dummy_prefix: bool, capacity: int, max_word_chars: int = 64) -> None:
        self._prefix = " " if dummy_prefix else ""
        self.capacity = capacity
        self.max_word_chars = max_word_chars
        self._words: dict[str, bytes] = {}
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._words)

    def encode_flat(
        self, texts: list[str], encode: Callable[[list[str]], list[list[int]]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ids of all ``texts`` concatenated (int32) and each text's number of ids.

        ``encode`` encodes a list of words (each alone, with no dummy prefix) to lists of ids.
        """
        prefix = self._prefix
        # an empty text has no dummy prefix either: SentencePiece encodes it to nothing
        split = [_WORDS.findall(prefix + t) if t else [] for t in texts]
        words = self._words
        seen: set[str] = set()
        for ws in split:
            seen.update(ws)
        new = list(seen.difference(words))
        count = sum(map(len, split))
        self.misses += len(new)
        self.hits += count - len(new)
        # Note: this call's new words go in first, so every look-up below is a plain dict
        # look-up; the cache is trimmed back to its bounds afterwards. They are encoded a
        # slice at a time: SentencePiece returns a list per word, and a few hundred
        # thousand of them alive at once would set off full garbage collections.
        for start in range(0, len(new), _ENCODE_SLICE):
            part = new[start : start + _ENCODE_SLICE]
            words.update(
                zip(part, (array("i", ids).tobytes() for ids in encode(part)), strict=True)
            )
        lookup = words.__getitem__
        encoded = [b"".join(map(lookup, ws)) for ws in split]
        if new:
            self._trim(new)
        lens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) // 4
        ids = np.frombuffer(bytearray().join(encoded), dtype=np.int32)  # writable
        return ids, lens

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
