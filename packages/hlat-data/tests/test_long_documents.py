"""Documents over ``max_chars`` pack to exactly the ids of encoding the whole text."""

from __future__ import annotations

import itertools
import random

import pyarrow as pa
import pytest
import sentencepiece

from hlat_data import ArrowSource, PackedLoader, Tokenizer

MAX_CHARS = 2000


def long_texts(documents: list[str]) -> list[str]:
    """Texts of 10,000+ characters: code with spaces and newlines, non-ASCII text, runs of
    spaces and a run with no space longer than ``MAX_CHARS``; and short ones between them."""
    code = "\n".join(d for d in documents if d)
    prose = "naïve café — 東京の夏 🙂👍🏽 x\u2581y  \u00ff\u01c2 \tend.\n"
    return [
        code[:12_000],
        "short one",
        (prose * 40 + code[3000:9000]) * 2,
        "x" * 2500 + " y" + "z" * 4000 + " " * 2500 + "a" * 3000 + "\n" * 10 + " é" * 900,
        " " * 5000 + "start " + code[:6000] + "  ",
        "",
        "\u2581" * 3000 + " " + code[:8000].replace("\n", " \n"),
    ]


def train_model(tmp_path, documents, name: str, **options) -> str:
    settings = dict(
        model_type="bpe",
        vocab_size=600,
        byte_fallback=True,
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


def packed_stream(path, tokenizer: Tokenizer) -> list[int]:
    loader = PackedLoader(
        ArrowSource(path, max_chars=MAX_CHARS), tokenizer, 256, 1, shuffle=False,
        block_size=1, num_epochs=1, drop_last=False, chunk_docs=3,
    )  # fmt: skip
    return [t for b in loader for t in b.input_ids[0][: b.doc_lens[0].sum()].tolist()]


@pytest.mark.parametrize("cache_size", [1 << 18, 0])
@pytest.mark.parametrize("model", ["identity", "nmt_nfkc", "unigram"])
def test_long_documents_pack_to_the_ids_of_the_whole_text(
    tmp_path, documents, tokenizer_path, model, cache_size
):
    if model == "identity":
        model_path = tokenizer_path  # train_tokenizer's settings
    elif model == "nmt_nfkc":
        model_path = train_model(tmp_path, documents, model, normalization_rule_name="nmt_nfkc")
    else:
        model_path = train_model(tmp_path, documents, model, model_type="unigram")
    texts = long_texts(documents)
    path = tmp_path / "long.arrow"
    table = pa.table({"text": texts})
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    source = ArrowSource(path, max_chars=MAX_CHARS)
    assert all(len(source.documents([i])[0]) > 1 for i, t in enumerate(texts) if len(t) > 10_000)
    sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
    expected = [t for text in texts if text for t in [*sp.encode(text), sp.eos_id()]]
    tokenizer = Tokenizer.from_file(model_path, num_threads=2, cache_size=cache_size)
    assert tokenizer.cuts_before_spaces == (model == "identity")
    if model == "identity" and cache_size:
        assert tokenizer.word_cache is not None
    assert packed_stream(path, tokenizer) == expected


@pytest.mark.parametrize("cache_size", [1 << 18, 0])
def test_documents_in_pieces_encode_as_their_whole_text_wherever_they_are_cut(
    tokenizer_path, documents, cache_size
):
    """Pieces cut anywhere (before a space after a non-space, inside words and runs of
    spaces, after newlines, empty ones) give the ids of the joined text; only the cuts
    before a space after a non-space are encoded apart."""
    rng = random.Random(0)
    texts = [t for t in long_texts(documents) if t]
    pieces = []
    for text in texts:
        cuts = sorted(rng.sample(range(1, len(text)), min(40, len(text) - 1)))
        cuts += [i for i in range(1, len(text)) if text[i] == " " and text[i - 1] != " "][::7]
        bounds = [0, *sorted(set(cuts)), len(text)]
        pieces.append([text[a:b] for a, b in itertools.pairwise(bounds)] + [""])
    tokenizer = Tokenizer.from_file(tokenizer_path, num_threads=2, cache_size=cache_size)
    assert tokenizer.cuts_before_spaces
    assert 1 < len(tokenizer._parts(pieces[0])) < len(pieces[0])  # some apart, some joined
    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_path)
    ids, counts = tokenizer.encode_documents([[], *pieces, ["x"]])
    expected = sp.encode([*texts, "x"])
    assert counts.tolist() == [0, *map(len, expected)]
    assert ids.tolist() == [i for e in expected for i in e]
