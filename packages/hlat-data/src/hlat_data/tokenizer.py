"""A thin, picklable tokenizer: SentencePiece models, or Hugging Face `tokenizers` JSON files."""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import os
import re
from typing import Any

import fsspec
import numpy as np

from hlat_data import wordcache
from hlat_data.errors import DataError

_SPACE = "\u2581"  # SentencePiece's symbol for a space
_SPACES = (" ", _SPACE)  # a space, and SentencePiece's symbol for it
# where :meth:`Tokenizer.encode_documents` may cut: before a space that follows a non-space
_BEFORE_SPACES = re.compile("(?<=[^ \u2581])(?=[ \u2581])")
# probe characters rare enough that small vocabularies lack them: controls, Latin, Tamil,
# Cyrillic, a symbol, and characters outside the Basic Multilingual Plane
_RARE = "\x01\x7f\u00ff\u01c2\u0b95\ua66e\u2603\U0001d11e\U000e0041\U0001fab8"
_HF_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
_HF_BOS = ("<s>", "<|begin_of_text|>", "<bos>")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def default_threads() -> int:
    """Encoding threads per process: this process's cores shared by the processes of its node
    (torchrun's ``LOCAL_WORLD_SIZE``), at least 1.

    Note: every rank tokenizes; 32 ranks on a 128-core trn1 node each starting 128 threads
    would oversubscribe the node 32 times over.
    """
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, usable_cores() // local)


class Tokenizer:
    """Batch encoding with the BOS/EOS ids the model defines.

    Build one with :meth:`from_file`. The object pickles as the model file's bytes, so it
    travels to worker processes cheaply and is rebuilt there.

    A SentencePiece BPE model with identity normalization (Llama's kind, and what
    :func:`train_tokenizer` writes) encodes through a word cache
    (:mod:`hlat_data.wordcache`): text is cut into words, and words further where no piece
    spans the cut; each part is encoded by SentencePiece once and looked up after that, with
    the same ids as encoding the whole text. Other models encode every text in full. The
    conditions are checked on the model file (:func:`~hlat_data.wordcache.cache_blocker`)
    and, at load, on probe texts (non-ASCII text, characters the vocabulary lacks next to
    spaces, the model's user-defined pieces) encoded both ways; a model that fails either
    encodes without the cache, the reason in :attr:`word_cache_unavailable`.

    A long document, given in pieces (:meth:`encode_documents`), encodes to the ids of its
    whole text: pieces are encoded apart only at cuts before a space that follows a
    non-space, and only for the models above (also with ``cache_size=0``); elsewhere they
    are joined back.

    Attributes:
        kind: ``"sentencepiece"`` or ``"hf"``.
        bos_id, eos_id: special ids (-1 when the model has none).
        vocab_size: number of ids.
        num_threads: threads used by :meth:`encode_batch`.
        cache_size: parts the word cache keeps at most (0: no cache).
        word_cache: the word cache (its ``hits`` and ``misses`` count look-ups), or None.
        word_cache_unavailable: why this model encodes without a word cache, or None.
        cuts_before_spaces: whether a text cut before a space that follows a non-space
            encodes apart (the part after the cut without a dummy prefix) to the ids of
            the whole text; what :meth:`encode_documents` relies on.
    """

    def __init__(
        self,
        kind: str,
        model: bytes,
        *,
        name: str = "",
        bos_token: str | None = None,
        eos_token: str | None = None,
        num_threads: int | None = None,
        cache_size: int = 1 << 18,
    ) -> None:
        if kind not in ("sentencepiece", "hf"):
            raise DataError(f"tokenizer kind must be 'sentencepiece' or 'hf', got {kind!r}")
        if cache_size < 0:
            raise DataError(f"cache_size must be 0 or more, got {cache_size}")
        if kind == "sentencepiece" and (bos_token is not None or eos_token is not None):
            raise DataError(
                f"tokenizer {name or '<bytes>'}: bos_token and eos_token name special tokens "
                "of a Hugging Face tokenizer.json; a SentencePiece model carries its own ids "
                "(train it with bos_id and eos_id)"
            )
        self.kind = kind
        self.name = name
        self._model = model
        self._bos_token = bos_token
        self._eos_token = eos_token
        self.num_threads = num_threads or default_threads()
        self.cache_size = cache_size
        self._impl: Any = None
        self._words_impl: Any = None  # the model without its dummy prefix, for single words
        self.cuts_before_spaces = False
        self.word_cache: wordcache.WordCache | None = None
        self.word_cache_unavailable: str | None = None
        self._load()

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        num_threads: int | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_size: int = 1 << 18,
    ) -> Tokenizer:
        """Load a SentencePiece ``.model`` or a Hugging Face ``tokenizer.json`` (by suffix).

        ``bos_token``/``eos_token`` name the special tokens of a Hugging Face tokenizer;
        by default they are the ones its post-processor puts around a text
        (:func:`template_specials`), else the first of ``</s>``, ``<|endoftext|>``,
        ``<|end_of_text|>``, ... (EOS) and ``<s>``, ``<|begin_of_text|>``, ... (BOS) it
        has. A SentencePiece model carries its own ids (naming tokens for one is refused).
        Local paths and fsspec URLs are accepted. ``cache_size`` bounds the word cache (about
        200 bytes a word; 0 turns it off).
        """
        url = os.fspath(path)
        try:
            with fsspec.open(url, "rb", **(storage_options or {})) as f:
                model = f.read()
        except FileNotFoundError:
            raise DataError(
                f"tokenizer file {url} not found; train one with "
                "`hlat-data train-tokenizer` or pass the path of a SentencePiece .model"
            ) from None
        kind = "hf" if url.endswith(".json") else "sentencepiece"
        return cls(
            kind,
            model,
            name=os.path.basename(url),
            bos_token=bos_token,
            eos_token=eos_token,
            num_threads=num_threads,
            cache_size=cache_size,
        )

    def _load(self) -> None:
        if self.kind == "sentencepiece":
            import sentencepiece

            processor = sentencepiece.SentencePieceProcessor()
            try:
                processor.LoadFromSerializedProto(self._model)
            except Exception as e:
                raise DataError(
                    f"tokenizer {self.name or '<bytes>'} is not a SentencePiece model ({e})"
                ) from None
            self._impl = processor
            self.vocab_size = processor.get_piece_size()
            self.bos_id = processor.bos_id()
            self.eos_id = processor.eos_id()
            self._load_word_cache()
            return
        try:
            import tokenizers
        except ImportError:
            raise DataError(
                "reading a tokenizer.json needs the `tokenizers` package: pip install tokenizers"
            ) from None
        try:
            impl = tokenizers.Tokenizer.from_str(self._model.decode())
        except Exception as e:
            raise DataError(f"tokenizer {self.name} is not a tokenizers JSON file ({e})") from None
        # documents are packed whole, as text: a file's truncation and padding (transformers
        # saves them) would cut each one and pack pad ids, and a special token's string in a
        # document would encode to its id (an EOS mid-document); the loader adds BOS/EOS
        impl.no_truncation()
        impl.no_padding()
        impl.encode_special_tokens = True
        self._impl = impl
        self.vocab_size = impl.get_vocab_size(with_added_tokens=True)
        bos, eos = template_specials(json.loads(self._model))
        self.bos_id = _token_id(impl, self._bos_token, bos, _HF_BOS, self.name)
        self.eos_id = _token_id(impl, self._eos_token, eos, _HF_EOS, self.name)

    def _load_word_cache(self) -> None:
        import sentencepiece

        self.word_cache, self._words_impl, self.cuts_before_spaces = None, None, False
        self.normalizes_first, self._dummy_prefix = False, False
        model, impl = self._model, self._impl
        reason = wordcache.cache_blocker(model, impl)
        if reason is not None and wordcache.normalizes(model) and self.cache_size:
            # Note: a normalizing model (nmt_nfkc, SentencePiece's default) is cached through
            # its identity twin: each text is normalized once by the model's own normalizer,
            # and the twin, which sees exactly that text, encodes it word by word
            twin = wordcache.prenormalized(model)
            twin_impl = sentencepiece.SentencePieceProcessor()
            twin_impl.LoadFromSerializedProto(twin)
            if wordcache.cache_blocker(twin, twin_impl) is None:
                model, impl, reason = twin, twin_impl, None
                self.normalizes_first = True
                self._dummy_prefix = wordcache.adds_dummy_prefix(model)
        probes: list[str] = []
        if reason is None:
            words = sentencepiece.SentencePieceProcessor()
            words.LoadFromSerializedProto(wordcache.without_dummy_prefix(model))
            self._words_impl = words
            probes = self._probes()
            # a normalizing model's documents are encoded whole: normalization may join
            # what a cut before a space would separate (collapsed whitespace)
            self.cuts_before_spaces = not self.normalizes_first
            if self.cuts_before_spaces:
                reason = self._disagreement(probes, cached=False)
                if reason is not None:
                    self._words_impl, self.cuts_before_spaces = None, False
        if self.cache_size == 0:
            self.word_cache_unavailable = "turned off (cache_size=0)"
            return
        if reason is None:
            self.word_cache = wordcache.WordCache(
                dummy_prefix=wordcache.adds_dummy_prefix(model),
                capacity=self.cache_size,
                cuts=wordcache.ascii_cuts(impl),
            )
            reason = self._disagreement(probes, cached=True)
            if reason is not None:
                self.word_cache, self.normalizes_first = None, False
        self.word_cache_unavailable = reason

    def _probes(self) -> list[str]:
        """Texts that exercise what the word cache and the cuts before spaces rely on:
        spaces (alone, in runs, written as ``▁``), tabs and newlines, digits, non-ASCII
        text, characters the vocabulary lacks (up to three of :data:`_RARE`) next to
        spaces and to each other, and the model's user-defined pieces (the first 64) in
        context, whole and in part."""
        impl = self._impl
        unknown = [c for c in _RARE if impl.is_unknown(impl.piece_to_id(c))][:3]
        u, v, w = (unknown + list(_RARE[-3:]))[:3]
        probes = [
            "",
            " ",
            "a",
            "  a  b  ",
            "x\u2581 y\u2581",
            "\u2581\u2581x \u2581",
            "\tdef f(x):\n    return 1  ",
            "12 345",
            "na\u00efve caf\u00e9 \u2014 \u6771\u4eac\u306e\u590f "
            "\U0001f642\U0001f44d\U0001f3fd \u00bd\ufb01",
            " \u00e9  \u65e5\u672c\u2581\u8a9e \u0645\u0631\u062d\u0628\u0627\n",
            f"{u} .",
            f"a {u} b",
            f"{u}{v} {w}",
            f"x{u}  y{v}",
            f" {u}",
            f"{u} ",
            f"{u}\u2581{v} \u2581{w}",
            f"({u}) = {v}\n{w}\t{u} {u}{u}",
        ]
        for symbol in wordcache.user_defined_symbols(self._model)[:64]:
            head, tail = symbol[:-1], symbol[1:]
            probes += [
                symbol,
                f" {symbol} ",
                f"x{symbol}y{symbol}{symbol}",
                f"{head} {tail}{head}{symbol}{tail}",
                f"{u}{symbol}{v} {symbol}{u}",
                f"a {symbol}\u2581{symbol}  b\n{symbol}",
            ]
        return probes

    def _disagreement(self, probes: list[str], *, cached: bool) -> str | None:
        """A last check of the conditions :mod:`~hlat_data.wordcache` relies on, on
        ``probes``: the word cache (``cached``) or the cuts before spaces alone must give
        SentencePiece's ids of each probe, whole and cut before each space that follows a
        non-space (as :meth:`encode_documents` cuts); None if they do."""
        direct = self._impl.encode(probes)
        cut = [_BEFORE_SPACES.split(p) for p in probes]
        got = [_as_lists(*self._encode_documents([[p] for p in probes], cached))]
        got.append(_as_lists(*self._encode_documents(cut, cached)))
        if any(g != direct for g in got):
            what = "word cache" if cached else "cuts before spaces"
            return f"its encodings through the {what} differ from SentencePiece's on a self-check"
        return None

    def _cached_flat(
        self, texts: list[str], continued: list[bool] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        assert self.word_cache is not None
        words, threads = self._words_impl, self.num_threads
        if self.normalizes_first:
            texts = self._normalize(texts)
        return self.word_cache.encode_flat(
            texts, lambda w: words.encode(w, num_threads=threads), continued
        )

    def _normalize(self, texts: list[str]) -> list[str]:
        """``texts`` as the model's own normalizer leaves them, spaces written as spaces
        and without the dummy prefix: what its identity twin encodes to the same ids."""
        out = self._impl.normalize(texts)
        if self._dummy_prefix:
            return [(t[1:] if t[:1] == _SPACE else t).replace(_SPACE, " ") for t in out]
        return [t.replace(_SPACE, " ") for t in out]

    def with_threads(self, num_threads: int) -> Tokenizer:
        """A copy that encodes batches with ``num_threads`` threads, with a word cache of its
        own (empty); the loaded model is shared, not loaded again."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.num_threads = num_threads
        if self.word_cache is not None:
            clone.word_cache = self.word_cache.empty_copy()
        return clone

    def encode(self, text: str) -> list[int]:
        """Ids of one text, without BOS/EOS."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without BOS/EOS, using :attr:`num_threads` threads."""
        if self.word_cache is not None:
            return _as_lists(*self._cached_flat(texts))
        if self.kind == "sentencepiece":
            return self._impl.encode(texts, num_threads=self.num_threads)
        encode = getattr(self._impl, "encode_batch_fast", self._impl.encode_batch)
        encodings = encode(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Ids of all texts concatenated (int32, without BOS/EOS) and each text's count
        (int64): :meth:`encode_batch` as two arrays, without a Python int per id when the
        word cache is on."""
        if self.word_cache is not None:
            return self._cached_flat(texts)
        return self._uncached_flat(texts)

    def _uncached_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self.kind == "sentencepiece":
            return _as_flat(self._impl.encode(texts, num_threads=self.num_threads))
        encode = getattr(self._impl, "encode_batch_fast", self._impl.encode_batch)
        return _as_flat([e.ids for e in encode(texts, add_special_tokens=False)])

    def encode_documents(self, documents: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
        """Ids of all documents concatenated (int32, without BOS/EOS) and each document's
        count (int64), where a document is given as the pieces of its text (as a source's
        ``documents`` returns a long one). The ids are exactly those of the whole text,
        ``encode("".join(pieces))``.

        Pieces are encoded separately only where that is proven to give the same ids: where
        a piece starts with a space (or ``▁``) and the piece before it ends with another
        character, when :attr:`cuts_before_spaces` (a SentencePiece BPE model the word
        cache's conditions hold for: the piece after such a cut is a run of words of its
        own, encoded without a dummy prefix). Any other pieces are joined back, so a model
        without proven cuts (a normalizing or unigram model, a Hugging Face tokenizer)
        encodes each document whole in one call.
        """
        return self._encode_documents(documents, self.word_cache is not None)

    def _encode_documents(
        self, documents: list[list[str]], cached: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        if all(len(pieces) <= 1 for pieces in documents):
            texts = [pieces[0] if pieces else "" for pieces in documents]
            return self._cached_flat(texts) if cached else self._uncached_flat(texts)
        texts, continued, owners = [], [], []
        for number, pieces in enumerate(documents):
            parts = self._parts(pieces)
            texts += parts
            continued += [False] + [True] * (len(parts) - 1) if parts else []
            owners += [number] * len(parts)
        if cached:
            ids, lens = self._cached_flat(texts, continued)
        elif any(continued):
            ids, lens = self._continued_flat(texts, continued)
        else:
            ids, lens = self._uncached_flat(texts)
        counts = np.bincount(
            np.asarray(owners, dtype=np.intp), weights=lens, minlength=len(documents)
        )
        return ids, counts.astype(np.int64)

    def _parts(self, pieces: list[str]) -> list[str]:
        """``pieces`` joined back where they may not be encoded apart."""
        if len(pieces) <= 1 or not self.cuts_before_spaces:
            return ["".join(pieces)]
        parts: list[str] = []
        current: list[str] = []
        last = ""  # the last character of ``current``
        for piece in pieces:
            if not piece:
                continue
            if current and piece[0] in _SPACES and last not in _SPACES:
                parts.append("".join(current))
                current = []
            current.append(piece)
            last = piece[-1]
        if current:
            parts.append("".join(current))
        return parts

    def _continued_flat(
        self, texts: list[str], continued: list[bool]
    ) -> tuple[np.ndarray, np.ndarray]:
        """SentencePiece's ids of ``texts``, the ``continued`` ones without dummy prefix."""
        starts = [t for t, more in zip(texts, continued, strict=True) if not more]
        rest = [t for t, more in zip(texts, continued, strict=True) if more]
        first_ids = iter(self._impl.encode(starts, num_threads=self.num_threads))
        rest_ids = iter(self._words_impl.encode(rest, num_threads=self.num_threads))
        return _as_flat([next(rest_ids) if more else next(first_ids) for more in continued])

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        return self._impl.decode(ids)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this tokenizer: a hash of the model file and the special ids."""
        digest = hashlib.sha256(self._model).hexdigest()[:16]
        return {
            "hash": digest,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_impl=None, _words_impl=None, word_cache=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._load()

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.kind}, {self.name!r}, vocab {self.vocab_size}, "
            f"bos {self.bos_id}, eos {self.eos_id})"
        )


def _as_flat(encoded: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The flat form of lists of ids: all ids (int32) and each list's length (int64)."""
    lens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32, count=int(lens.sum()))
    return ids, lens


def _as_lists(ids: np.ndarray, lens: np.ndarray) -> list[list[int]]:
    """The ids of each text, from the flat form."""
    ends = np.cumsum(lens).tolist()
    return [ids[end - n : end].tolist() for end, n in zip(ends, lens.tolist(), strict=True)]


def template_specials(spec: dict[str, Any]) -> tuple[str | None, str | None]:
    """BOS and EOS as a ``tokenizer.json``'s post-processor adds them to a single text.

    ``TemplateProcessing`` (also inside a ``Sequence``, as Llama 3's): the special token
    before ``$A`` is BOS, the one after it EOS; ``BertProcessing``/``RobertaProcessing``:
    ``cls`` and ``sep``. ``(None, None)`` for a tokenizer that adds none.
    """
    processor = spec.get("post_processor") or {}
    stack = [processor]
    while stack:
        item = stack.pop(0)
        kind = item.get("type")
        if kind == "Sequence":
            stack.extend(item.get("processors", []))
        elif kind == "TemplateProcessing":
            pieces = item.get("single", [])
            where = next((i for i, p in enumerate(pieces) if "Sequence" in p), None)
            if where is None:
                continue
            before = [p["SpecialToken"]["id"] for p in pieces[:where] if "SpecialToken" in p]
            after = [p["SpecialToken"]["id"] for p in pieces[where + 1 :] if "SpecialToken" in p]
            return (before[-1] if before else None), (after[0] if after else None)
        elif kind in ("BertProcessing", "RobertaProcessing"):
            return item["cls"][0], item["sep"][0]
    return None, None


def _token_id(
    impl: Any, wanted: str | None, template: str | None, candidates: tuple[str, ...], name: str
) -> int:
    """The id of ``wanted`` (the caller's choice), else the post-processor's token, else the
    first known name the vocabulary has; -1 for none."""
    if wanted is not None:
        token_id = impl.token_to_id(wanted)
        if token_id is None:
            raise DataError(f"tokenizer {name} has no token {wanted!r}")
        return int(token_id)
    if template is not None and impl.token_to_id(template) is not None:
        return int(impl.token_to_id(template))
    for token in candidates:
        token_id = impl.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return -1


def train_tokenizer(
    inputs: str | os.PathLike[str] | list[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    vocab_size: int = 32000,
    *,
    text_column: str = "text",
    model_type: str = "bpe",
    byte_fallback: bool = True,
    max_chars: int = 200_000_000,
    num_threads: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Train a SentencePiece model with Llama-2's settings and write it.

    Llama-2's settings keep text exactly as it is: identity normalisation, no collapsing of
    whitespace, whitespace-only pieces (indentation), digits split, byte fallback for
    newlines and rare characters. Code keeps its layout, and Hugging Face's
    ``LlamaTokenizer`` reproduces the ids. Documents are fed in pieces of up to 2,000
    characters (SentencePiece drops longer sentences); a corpus too small for
    ``vocab_size`` gets fewer pieces instead of an error.

    Args:
        inputs: Arrow/Parquet files or directories (anything :class:`ArrowSource` reads;
            null texts are skipped), JSON lines (``.jsonl``, ``.ndjson``, ``.json``, plain,
            ``.gz`` or ``.zst``, read by :class:`~hlat_data.JsonlSource`; bad records are
            skipped) or directories of them, or UTF-8 text files, one document each
            (``.txt``, ``.md`` or any suffix it does not know). Each file a glob matches is
            read by its own suffix, as ``convert_to_arrow`` reads it.
        text_column: the column (Arrow, Parquet) or field (JSON lines) with the text.
        output: where to write the model, a local path (its directory is created);
            ``.model`` is appended when missing, and a ``.vocab`` file is written next to it.
        vocab_size: number of pieces (at most).
        max_chars: characters fed to the trainer at most, documents in order.

    Returns:
        The path of the written ``.model`` file. Ids: 0 unk, 1 BOS, 2 EOS.

    Raises:
        DataError: for an input that cannot be read (naming it), or inputs without text.
    """
    import sentencepiece

    from hlat_data.convert import _expand, _input_kind
    from hlat_data.jsonl import JsonlSource
    from hlat_data.source import ArrowSource

    entries = [
        os.fspath(e) for e in ([inputs] if isinstance(inputs, str | os.PathLike) else inputs)
    ]
    prefix = os.fspath(output)
    prefix = prefix[: -len(".model")] if prefix.endswith(".model") else prefix
    if not entries:
        raise DataError("train_tokenizer needs at least one input file")
    if vocab_size < 8:
        raise DataError(f"vocab_size must be at least 8, got {vocab_size}")
    if "://" in prefix:
        raise DataError(
            f"train_tokenizer writes the model to a local path, got {prefix}; write it "
            "locally and copy it"
        )

    # the tables and JSON lines are opened (and checked) before training starts; globs and
    # directories are expanded first and each file read by its own name, as convert does
    inputs_read: list[ArrowSource | JsonlSource | str] = []
    for entry in _expand(entries, storage_options or {}):
        fs, path = fsspec.core.url_to_fs(entry, **(storage_options or {}))
        kind = _input_kind(fs, path)
        if kind == "jsonl":
            inputs_read.append(
                JsonlSource(
                    entry, text_column, on_bad_record="skip", storage_options=storage_options
                )
            )
        elif kind == "text":  # one document each
            inputs_read.append(entry)
        else:
            inputs_read.append(
                ArrowSource(
                    entry, text_column=text_column, nulls="skip", storage_options=storage_options
                )
            )
    try:  # SentencePiece writes the model only after training
        os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the directory of {prefix}: {e.strerror}") from None
    bad = [0]  # records skipped

    def documents() -> Any:
        for source in inputs_read:
            if not isinstance(source, str):
                for start in range(0, len(source), 256):
                    texts, skipped = source.texts_with_bad(
                        range(start, min(start + 256, len(source)))
                    )
                    bad[0] += len(skipped)
                    yield from texts
                continue
            # max_chars characters take 4 bytes each at most: no more is read
            limit = 4 * max_chars
            try:
                with fsspec.open(source, "rb", **(storage_options or {})) as f:
                    data = f.read(limit)
                    whole = len(data) < limit or not f.read(1)
            except FileNotFoundError:
                raise DataError(f"{source}: no such file") from None
            try:
                # a character cut by the limit is left out, not an error
                yield codecs.getincrementaldecoder("utf-8")().decode(data, final=whole)
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{source}: not UTF-8 text ({e.reason} at byte {e.start}); train_tokenizer "
                    "reads Arrow and Parquet files and directories, JSON lines (.jsonl, "
                    ".ndjson, .json; plain, .gz or .zst) and UTF-8 text files"
                ) from None

    def pieces() -> Any:
        fed = 0
        for document in documents():
            for i in range(0, len(document), 2000):
                piece = document[i : i + min(2000, max_chars - fed)]
                if piece.strip():
                    yield piece
                    fed += len(piece)
                if fed >= max_chars:
                    return
        if not fed:
            skipped = f", {bad[0]} bad records or null texts skipped" if bad[0] else ""
            hint = (
                f"; check that text_column ({text_column!r}) names the text"
                if any(not isinstance(source, str) for source in inputs_read)
                else ""
            )
            raise DataError(
                f"no text to train on in {', '.join(entries)} (every document is empty"
                f"{skipped}){hint}"
            )

    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=pieces(),
            model_prefix=prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=byte_fallback,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=0.9995,
            max_sentence_length=8192,
            hard_vocab_limit=False,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise DataError(f"SentencePiece training failed: {e}") from None
    return prefix + ".model"
