"""The word cache gives SentencePiece's own ids, and stays off where it could not."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
import sentencepiece

from hlat_data import DataError, Tokenizer
from hlat_data.wordcache import _WORDS, adds_dummy_prefix, without_dummy_prefix

# Characters that exercise every rule the cache relies on: spaces (single and in runs),
# SentencePiece's own whitespace symbol written literally, tabs and newlines (no spaces for
# SentencePiece), digits (split one by one), letters, punctuation, characters outside the
# vocabulary (byte fallback) and a character outside the Basic Multilingual Plane.
ALPHABET = list("    \u2581\u2581\t\n\n0123456789abcdefxyz_.,:()[]'\"#=é日本\U0001f600")


def random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choices(ALPHABET, k=rng.randint(1, 12))) for _ in range(60)]
    texts = ["", " ", "  ", "\u2581", " \u2581 ", "a", " a", "a ", "1 2  3", "x\u2581 y\u2581"]
    for _ in range(count):
        parts = rng.choices(words, k=rng.randint(0, 30))
        texts.append("".join(p if rng.random() < 0.7 else " " + p for p in parts))
    return texts


def sentencepiece_ids(model_path: str, texts: list[str]) -> list[list[int]]:
    return sentencepiece.SentencePieceProcessor(model_file=model_path).encode(texts)


def train(tmp_path, documents, name, **options) -> str:
    """A small SentencePiece model on the test corpus, with ``train_tokenizer``'s settings
    unless ``options`` change them."""
    settings = dict(
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    settings.update(options)
    prefix = str(tmp_path / name)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([d for d in documents if d.strip()]),
        model_prefix=prefix,
        **settings,
    )
    return prefix + ".model"


def test_cached_ids_equal_sentencepiece_on_code_and_random_text(tokenizer_path, documents):
    tokenizer = Tokenizer.from_file(tokenizer_path, num_threads=1)
    assert tokenizer.word_cache is not None, tokenizer.word_cache_unavailable
    texts = [*documents, *random_texts(300)]
    expected = sentencepiece_ids(tokenizer_path, texts)
    assert tokenizer.encode_batch(texts) == expected
    # a second pass answers from the cache, with the same ids; only the words too long to
    # keep are encoded again
    misses = tokenizer.word_cache.misses
    assert tokenizer.encode_batch(texts) == expected
    long_words = {w for t in texts for w in _WORDS.findall(" " + t) if len(w) > 64}
    assert tokenizer.word_cache.misses - misses == len(long_words)


def test_flat_encoding_is_the_batch_encoding_concatenated(tokenizer_path, documents):
    tokenizer = Tokenizer.from_file(tokenizer_path, num_threads=2)
    texts = [*documents[:20], *random_texts(50, seed=1)]
    expected = sentencepiece_ids(tokenizer_path, texts)
    ids, lens = tokenizer.encode_flat(texts)
    assert lens.tolist() == [len(e) for e in expected]
    assert ids.tolist() == [i for e in expected for i in e]
    assert str(ids.dtype) == "int32"


def test_a_full_cache_drops_its_oldest_words_and_stays_exact(tokenizer_path, documents):
    tokenizer = Tokenizer.from_file(tokenizer_path, num_threads=1, cache_size=64)
    texts = [*documents, *random_texts(200, seed=2)]
    expected = sentencepiece_ids(tokenizer_path, texts)
    got = []
    for start in range(0, len(texts), 7):
        got += tokenizer.encode_batch(texts[start : start + 7])
        assert len(tokenizer.word_cache) <= 64
    assert got == expected


def test_words_longer_than_the_limit_are_encoded_but_not_kept(tokenizer_path):
    tokenizer = Tokenizer.from_file(tokenizer_path, num_threads=1)
    long_word = " " + "abcdefgh" * 20
    assert tokenizer.encode_batch([long_word, "x" + long_word]) == sentencepiece_ids(
        tokenizer_path, [long_word, "x" + long_word]
    )
    assert long_word not in tokenizer.word_cache._words


def test_a_model_without_dummy_prefix_is_cached_exactly(tmp_path, documents):
    model = train(tmp_path, documents, "no-prefix", add_dummy_prefix=False)
    assert not adds_dummy_prefix(Path(model).read_bytes())
    tokenizer = Tokenizer.from_file(model, num_threads=1)
    assert tokenizer.word_cache is not None, tokenizer.word_cache_unavailable
    texts = [*documents, *random_texts(200, seed=3)]
    assert tokenizer.encode_batch(texts) == sentencepiece_ids(model, texts)


def test_switching_off_the_dummy_prefix_keeps_the_rest_of_the_model(tokenizer_path):
    model = Path(tokenizer_path).read_bytes()
    assert adds_dummy_prefix(model)
    edited = without_dummy_prefix(model)
    assert not adds_dummy_prefix(edited)
    plain = sentencepiece.SentencePieceProcessor()
    plain.LoadFromSerializedProto(edited)
    original = sentencepiece.SentencePieceProcessor(model_file=tokenizer_path)
    assert plain.get_piece_size() == original.get_piece_size()
    assert plain.encode("x", out_type=str) == ["x"]
    assert original.encode("x", out_type=str)[0].startswith("\u2581")
    assert plain.encode(" x = 1") == original.encode("x = 1")  # the space is the prefix


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"model_type": "unigram"}, "not a BPE model"),
        ({"normalization_rule_name": "nmt_nfkc"}, "the normalizer maps characters"),
        ({"remove_extra_whitespaces": True}, "the normalizer collapses whitespace"),
        # a piece across words (SentencePiece's BPE trainer makes none; a user-defined
        # symbol can be one, and matches before BPE runs)
        ({"user_defined_symbols": ["x\u2581="]}, "has whitespace after other characters"),
    ],
)
def test_models_the_cache_cannot_reproduce_encode_without_it(tmp_path, documents, options, reason):
    model = train(tmp_path, documents, "model", **options)
    tokenizer = Tokenizer.from_file(model, num_threads=1)
    assert tokenizer.word_cache is None
    assert reason in tokenizer.word_cache_unavailable
    texts = [*documents[:10], *random_texts(50, seed=4), "x = 1"]
    assert tokenizer.encode_batch(texts) == sentencepiece_ids(model, texts)


def test_cache_size_zero_turns_it_off_and_a_negative_size_is_an_error(tokenizer_path):
    tokenizer = Tokenizer.from_file(tokenizer_path, cache_size=0)
    assert tokenizer.word_cache is None
    assert tokenizer.word_cache_unavailable == "turned off (cache_size=0)"
    with pytest.raises(DataError, match="cache_size must be 0 or more, got -1"):
        Tokenizer.from_file(tokenizer_path, cache_size=-1)


def test_a_pickled_tokenizer_builds_its_own_cache(tokenizer_path, documents):
    tokenizer = Tokenizer.from_file(tokenizer_path, num_threads=1)
    tokenizer.encode_batch(documents)
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.word_cache is not None and clone.word_cache is not tokenizer.word_cache
    assert len(clone.word_cache) < len(tokenizer.word_cache)  # not shipped with the pickle
    assert clone.encode_batch(documents) == sentencepiece_ids(tokenizer_path, documents)


@pytest.mark.parametrize("cache_size", [0, 1 << 18])
def test_an_empty_batch_encodes_to_nothing_and_flat_ids_are_writable(tokenizer_path, cache_size):
    tokenizer = Tokenizer.from_file(tokenizer_path, cache_size=cache_size)
    assert tokenizer.encode_batch([]) == []
    ids, lens = tokenizer.encode_flat([])
    assert (ids.size, lens.size) == (0, 0)
    ids, lens = tokenizer.encode_flat(["x = 1", ""])
    assert lens[1] == 0
    ids[0] = 7  # a caller may reuse the buffer
