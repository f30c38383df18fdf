"""The word cache gives SentencePiece's own ids, and stays off where it could not."""

from __future__ import annotations

import pickle
import random
import re
from pathlib import Path

import pytest
import sentencepiece

from hlat_data import DataError, Tokenizer
from hlat_data.wordcache import adds_dummy_prefix, ascii_cuts, without_dummy_prefix

# Whitespace-delimited words: a run of spaces (or of SentencePiece's whitespace symbol) then a
# run of other characters; or trailing spaces.
WORDS = re.compile("[ \u2581]*[^ \u2581]+|[ \u2581]+\\Z")


def merged_pieces(model_path: str) -> list[str]:
    """The pieces BPE merges into, ``▁`` written as a space."""
    sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
    return [
        sp.id_to_piece(i).replace("\u2581", " ")
        for i in range(sp.get_piece_size())
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))
    ]


def cache_keys(model_path: str, text: str) -> list[str]:
    """The pieces the cache cuts ``text`` into, by its rule written out plainly: before a
    space after a non-space, and between two ASCII characters that are pieces of their own
    and that no piece holds side by side."""
    pieces = merged_pieces(model_path)
    pairs = {p[k : k + 2] for p in pieces for k in range(len(p) - 1)}
    singles = {p for p in pieces if len(p) == 1 and p.isascii()}
    text = " " + text.replace("\u2581", " ")
    keys, start = [], 0
    for i in range(1, len(text)):
        a, b = text[i - 1], text[i]
        if (b == " " and a != " ") or (a in singles and b in singles and a + b not in pairs):
            keys.append(text[start:i])
            start = i
    return [*keys, text[start:]]


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
    # a second pass answers from the cache, with the same ids; only the pieces too long to
    # keep are encoded again
    misses = tokenizer.word_cache.misses
    assert tokenizer.encode_batch(texts) == expected
    long_keys = {k for t in texts if t for k in cache_keys(tokenizer_path, t) if len(k) > 64}
    assert long_keys
    assert tokenizer.word_cache.misses - misses == len(long_keys)


def test_words_are_also_cut_between_ascii_characters_no_piece_joins(tokenizer_path):
    tokenizer = Tokenizer.from_file(tokenizer_path, num_threads=1)
    pieces = merged_pieces(tokenizer_path)
    pairs = {p[k : k + 2] for p in pieces for k in range(len(p) - 1)}
    singles = {p for p in pieces if len(p) == 1 and p.isascii()}
    table = ascii_cuts(tokenizer._impl).reshape(256, 256)
    for a in range(256):
        for b in range(256):
            cut = chr(a) in singles and chr(b) in singles and chr(a) + chr(b) not in pairs
            assert table[a, b] == cut, (chr(a), chr(b))
    assert table.sum() > 1000  # a code vocabulary of 512 pieces leaves most pairs apart


def test_runs_of_characters_outside_the_vocabulary_stay_one_unknown_piece(tmp_path, documents):
    """Without byte fallback, SentencePiece folds a run of unknown characters into one
    unknown piece; the cache must not cut such a run, even between ASCII characters."""
    model = train(tmp_path, documents, "no-fallback", byte_fallback=False)
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    assert sp.encode("\x01\x02", out_type=str)[-1] == "\x01\x02"  # one piece, unknown
    tokenizer = Tokenizer.from_file(model, num_threads=1)
    assert tokenizer.word_cache is not None, tokenizer.word_cache_unavailable
    texts = ["\x01\x02", "a\x01\x02b", "x=\x01\x02\x03;", "(\x7f\x01)", *documents[:5]]
    assert tokenizer.encode_batch(texts) == sentencepiece_ids(model, texts)


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


NORMALIZED = [
    "\uff46\uff55\uff4c\uff4c\uff57\uff49\uff44\uff54\uff48 \uff21\uff22\uff23 \uff11\uff12\uff13 \ufb01 \u00bd \u2460",
    "  leading,  double   spaces\tand a tab, trailing  ",
    "\u2581 already \u2581\u2581 escaped \u2581",
    "na\u00efve cafe\u0301 \u6771\u4eac \U0001f642 x\u00a0y \u3000 z",
    "",
    " ",
    "\n\n\t",
]


@pytest.mark.parametrize(
    "options",
    [
        # SentencePiece's defaults
        {
            "normalization_rule_name": "nmt_nfkc",
            "remove_extra_whitespaces": True,
            "allow_whitespace_only_pieces": False,
        },
        {"normalization_rule_name": "nfkc_cf"},
        {"remove_extra_whitespaces": True},
    ],
    ids=["nmt_nfkc", "nfkc_cf", "collapsed-whitespace"],
)
def test_normalizing_models_are_cached_through_their_own_normalizer(tmp_path, documents, options):
    """SentencePiece's default (``nmt_nfkc``) and other normalizing models: each text is
    normalized once by the model, then encoded word by word by its identity twin."""
    model = train(tmp_path, documents, "model", **options)
    tokenizer = Tokenizer.from_file(model, num_threads=1)
    assert tokenizer.word_cache is not None and tokenizer.normalizes_first
    assert tokenizer.word_cache_unavailable is None
    texts = [*documents[:10], *random_texts(50, seed=4), *NORMALIZED]
    assert tokenizer.encode_batch(texts) == sentencepiece_ids(model, texts)
    again = tokenizer.encode_batch(texts)  # now from the cache
    assert again == sentencepiece_ids(model, texts) and len(tokenizer.word_cache) > 0
    uncached = Tokenizer.from_file(model, num_threads=1, cache_size=0)
    assert not uncached.normalizes_first
    assert uncached.encode_batch(texts) == sentencepiece_ids(model, texts)


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


def test_a_copy_with_other_threads_shares_the_model_and_has_its_own_cache(
    tokenizer_path, documents
):
    tokenizer = Tokenizer.from_file(tokenizer_path, num_threads=1)
    tokenizer.encode_batch(documents[:5])
    clone = tokenizer.with_threads(2)
    assert (clone.num_threads, tokenizer.num_threads) == (2, 1)
    assert clone._impl is tokenizer._impl  # not loaded again
    assert clone.word_cache is not tokenizer.word_cache and len(clone.word_cache) == 0
    assert clone.encode_batch(documents) == sentencepiece_ids(tokenizer_path, documents)
    shipped = pickle.loads(pickle.dumps(clone))  # as the loader sends it to its workers
    assert shipped.num_threads == 2
    assert shipped.encode_batch(documents[:5]) == sentencepiece_ids(tokenizer_path, documents[:5])


# Characters no vocabulary trained on the test corpus holds (checked where they matter).
UNKNOWN = "\u00ff\u01c2\ua66e"


def without_lone_space_piece(model_path: str, out: Path) -> str:
    """The model with its piece ``▁`` renamed to ``☃``: a vocabulary with pieces that start
    with ``▁`` but none that is ``▁`` alone. (SentencePiece's trainer always keeps each
    frequent character as a piece, so such a vocabulary is made by editing one.)"""
    data = Path(model_path).read_bytes()
    # the piece field (1) of a SentencePiece message, 3 bytes long, then its score field (2)
    lone = b"\x0a\x03" + "\u2581".encode() + b"\x15"
    assert data.count(lone) == 1
    out.write_bytes(data.replace(lone, b"\x0a\x03" + "\u2603".encode() + b"\x15"))
    return str(out)


def test_a_vocabulary_without_a_lone_space_piece_or_byte_fallback_encodes_exactly(
    tmp_path, documents
):
    """Without byte fallback, SentencePiece folds a run of unknown pieces into one; when
    ``▁`` alone is no piece, a space after an unknown character joins that run, so the cut
    before the space would split it. Such a model encodes without the cut."""
    trained = train(tmp_path, documents, "plain", byte_fallback=False)
    model = without_lone_space_piece(trained, tmp_path / "no-lone-space.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    assert sp.is_unknown(sp.piece_to_id("\u2581"))
    # the dummy prefix, the unknown character and the space: one unknown piece
    assert sp.encode("\u00ff .", out_type=str)[0] == "\u2581\u00ff\u2581"
    assert all(sp.is_unknown(sp.piece_to_id(c)) for c in UNKNOWN)
    tokenizer = Tokenizer.from_file(model, num_threads=1)
    texts = [
        "\u00ff .",
        "a \u00ff b",
        "\u00ff\u01c2 \ua66e",
        "x\u00ff  y",
        " \u00ff",
        "\u00ff ",
        "(\u00ff) = \ua66e\u2581\u00ff",
        *documents[:5],
        *random_texts(50, seed=5),
    ]
    assert tokenizer.encode_batch(texts) == sentencepiece_ids(model, texts)
    assert tokenizer.word_cache is None
    assert "no piece" in tokenizer.word_cache_unavailable


def test_the_load_time_self_check_covers_unknown_characters_next_to_spaces(
    tmp_path, documents, monkeypatch
):
    """With the model check passed by force, the probe texts alone must catch a model the
    cache would encode differently (unknown characters before a space, no lone ``▁``)."""
    from hlat_data import wordcache

    trained = train(tmp_path, documents, "plain", byte_fallback=False)
    model = without_lone_space_piece(trained, tmp_path / "no-lone-space.model")
    monkeypatch.setattr(wordcache, "cache_blocker", lambda model, processor: None)
    tokenizer = Tokenizer.from_file(model, num_threads=1)
    assert tokenizer.word_cache is None
    assert "self-check" in tokenizer.word_cache_unavailable


def test_user_defined_symbols_are_cached_exactly_and_probed_at_load(
    tmp_path, documents, monkeypatch
):
    """A user-defined symbol is matched whole before BPE runs; the cache keeps it whole,
    and the load-time probes contain the model's symbols, so a cache that cut one apart
    would be caught."""
    from hlat_data import wordcache

    model = train(tmp_path, documents, "tools", user_defined_symbols=["<tool>", "</tool>"])
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    assert sp.encode("x<tool>y", out_type=str).count("<tool>") == 1
    tokenizer = Tokenizer.from_file(model, num_threads=1)
    assert tokenizer.word_cache is not None, tokenizer.word_cache_unavailable
    texts = [
        "<tool>",
        " <tool> ",
        "a<tool>b</tool>c",
        "<tool><tool></tool>",
        "<too <tool <tool>> </tool",
        f"x {UNKNOWN[0]}<tool>{UNKNOWN[1]} </tool>\n\t(<tool>)",
        *[d.replace("def ", "def <tool> ") for d in documents[:10]],
        *random_texts(50, seed=6),
    ]
    assert tokenizer.encode_batch(texts) == sentencepiece_ids(model, texts)

    # a cache that cut "<tool>" between "o" and "l" (no other probe holds that pair)
    real_cuts = wordcache.ascii_cuts

    def cutting_symbols(processor):
        table = real_cuts(processor).copy()
        table[ord("o") * 256 + ord("l")] = True
        return table

    monkeypatch.setattr(wordcache, "ascii_cuts", cutting_symbols)
    broken = Tokenizer.from_file(model, num_threads=1)
    assert broken.word_cache is None
    assert "self-check" in broken.word_cache_unavailable
