"""A thin, picklable tokenizer: SentencePiece models, or Hugging Face `tokenizers` JSON files."""

from __future__ import annotations

import hashlib
import itertools
import os
from typing import Any

import fsspec
import numpy as np

from hlat_data import wordcache
from hlat_data.errors import DataError

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
    the same ids as encoding the whole text. Other models encode every text in full.

    Attributes:
        kind: ``"sentencepiece"`` or ``"hf"``.
        bos_id, eos_id: special ids (-1 when the model has none).
        vocab_size: number of ids.
        num_threads: threads used by :meth:`encode_batch`.
        cache_size: parts the word cache keeps at most (0: no cache).
        word_cache: the word cache (its ``hits`` and ``misses`` count look-ups), or None.
        word_cache_unavailable: why this model encodes without a word cache, or None.
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
        self.kind = kind
        self.name = name
        self._model = model
        self._bos_token = bos_token
        self._eos_token = eos_token
        self.num_threads = num_threads or default_threads()
        self.cache_size = cache_size
        self._impl: Any = None
        self._words_impl: Any = None  # the model without its dummy prefix, for single words
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

        ``bos_token``/``eos_token`` name the special tokens of a Hugging Face tokenizer
        (default: the first of ``</s>``, ``<|endoftext|>``, ... it knows); a SentencePiece
        model carries its own ids. Local paths and fsspec URLs are accepted. ``cache_size``
        bounds the word cache (about 200 bytes a word; 0 turns it off).
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
        self._impl = impl
        self.vocab_size = impl.get_vocab_size(with_added_tokens=True)
        self.bos_id = _token_id(impl, self._bos_token, _HF_BOS, self.name)
        self.eos_id = _token_id(impl, self._eos_token, _HF_EOS, self.name)

    def _load_word_cache(self) -> None:
        if self.cache_size == 0:
            self.word_cache_unavailable = "turned off (cache_size=0)"
            return
        import sentencepiece

        reason = wordcache.cache_blocker(self._model, self._impl)
        if reason is None:
            words = sentencepiece.SentencePieceProcessor()
            words.LoadFromSerializedProto(wordcache.without_dummy_prefix(self._model))
            self._words_impl = words
            self.word_cache = wordcache.WordCache(
                dummy_prefix=wordcache.adds_dummy_prefix(self._model),
                capacity=self.cache_size,
                cuts=wordcache.ascii_cuts(self._impl),
            )
            reason = self._word_cache_disagreement()
        if reason is not None:
            self.word_cache, self._words_impl = None, None
        self.word_cache_unavailable = reason

    def _word_cache_disagreement(self) -> str | None:
        """A last check of the conditions :mod:`~hlat_data.wordcache` relies on, on texts
        that exercise them; None if the cache gives SentencePiece's ids on all of them."""
        probes = [
            "",
            " ",
            "a",
            "  a  b  ",
            "x\u2581 y\u2581",
            "\tdef f(x):\n    return 1  ",
            "12 345",
        ]
        direct = self._impl.encode(probes)
        if _as_lists(*self._cached_flat(probes)) != direct:
            return "its encodings differ from SentencePiece's on a self-check"
        return None

    def _cached_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        assert self.word_cache is not None
        words, threads = self._words_impl, self.num_threads
        return self.word_cache.encode_flat(texts, lambda w: words.encode(w, num_threads=threads))

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
        encoded = self.encode_batch(texts)
        lens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = np.fromiter(
            itertools.chain.from_iterable(encoded), dtype=np.int32, count=int(lens.sum())
        )
        return ids, lens

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        return self._impl.decode(ids)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this tokenizer: a hash of the model file and the special ids."""
        digest = hashlib.sha256(self._model).hexdigest()[:16]
        return {"hash": digest, "vocab_size": self.vocab_size, "eos_id": self.eos_id}

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


def _as_lists(ids: np.ndarray, lens: np.ndarray) -> list[list[int]]:
    """The ids of each text, from the flat form."""
    ends = np.cumsum(lens).tolist()
    return [ids[end - n : end].tolist() for end, n in zip(ends, lens.tolist(), strict=True)]


def _token_id(impl: Any, wanted: str | None, candidates: tuple[str, ...], name: str) -> int:
    if wanted is not None:
        token_id = impl.token_to_id(wanted)
        if token_id is None:
            raise DataError(f"tokenizer {name} has no token {wanted!r}")
        return int(token_id)
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
        inputs: Arrow/Parquet files or directories (anything :class:`ArrowSource` reads),
            or plain text files (``.txt``, ``.md`` or any suffix it does not know).
        output: where to write the model; ``.model`` is appended when missing, and a
            ``.vocab`` file is written next to it.
        vocab_size: number of pieces (at most).
        max_chars: characters fed to the trainer at most, documents in order.

    Returns:
        The path of the written ``.model`` file. Ids: 0 unk, 1 BOS, 2 EOS.
    """
    import sentencepiece

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

    def documents() -> Any:
        for entry in entries:
            if entry.endswith((".arrow", ".parquet", ".pq", ".ipc", ".feather")) or os.path.isdir(
                entry
            ):
                source = ArrowSource(
                    entry, text_column=text_column, nulls="skip", storage_options=storage_options
                )
                for start in range(0, len(source), 256):
                    yield from source.texts(range(start, min(start + 256, len(source))))
            else:
                try:
                    with fsspec.open(entry, "rt", encoding="utf-8", **(storage_options or {})) as f:
                        yield f.read()
                except FileNotFoundError:
                    raise DataError(f"{entry}: no such file") from None

    def pieces() -> Any:
        fed = 0
        for document in documents():
            for i in range(0, len(document), 2000):
                piece = document[i : i + 2000]
                if piece.strip():
                    yield piece
                    fed += len(piece)
            if fed >= max_chars:
                return

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
