from __future__ import annotations

import pickle

import numpy as np
import pytest

from hlat_data import ArrowSource, DataError, PackedLoader, Tokenizer


def test_sentencepiece_ids_come_from_the_model_and_survive_pickling(tokenizer, documents):
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    clone = pickle.loads(pickle.dumps(tokenizer))
    texts = [d for d in documents if d][:5]
    assert clone.encode_batch(texts) == tokenizer.encode_batch(texts)
    assert clone.fingerprint() == tokenizer.fingerprint()


def test_batch_encoding_on_several_threads_equals_one_by_one(tokenizer_path, documents):
    tokenizer = Tokenizer.from_file(tokenizer_path, num_threads=2)
    texts = [d for d in documents if d]
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]


def test_hugging_face_tokenizer_json_packs_with_its_eos(tmp_path, corpus, documents):
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"]
    )
    model.train_from_iterator([d for d in documents if d], trainer)
    model.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert (tokenizer.kind, tokenizer.bos_id, tokenizer.eos_id) == ("hf", 1, 2)
    loader = PackedLoader(
        ArrowSource(corpus), tokenizer, 64, 2, block_size=4, num_epochs=1, drop_last=False
    )
    eos = sum(int((b.input_ids.reshape(-1)[: b.doc_lens.sum()] == 2).sum()) for b in loader)
    assert eos == sum(1 for d in documents if d)
    assert pickle.loads(pickle.dumps(tokenizer)).encode("def f(): pass") == tokenizer.encode(
        "def f(): pass"
    )


def _byte_level_bpe(documents, specials):
    tokenizers = pytest.importorskip("tokenizers")
    pre = tokenizers.pre_tokenizers
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    model.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre.ByteLevel.alphabet()
    )
    model.train_from_iterator([d for d in documents if d], trainer)
    return model


def test_a_tokenizer_json_s_truncation_and_padding_are_turned_off(tmp_path, corpus, documents):
    model = _byte_level_bpe(documents, ["<|endoftext|>", "<pad>"])
    texts = [d for d in documents if d]
    whole = [e.ids for e in model.encode_batch(texts, add_special_tokens=False)]
    # as transformers' fast tokenizers save them
    model.enable_truncation(32)
    model.enable_padding(pad_id=1, pad_token="<pad>")
    model.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tokenizer.encode_batch(texts) == whole
    assert pickle.loads(pickle.dumps(tokenizer)).encode_batch(texts[:3]) == whole[:3]
    loader = PackedLoader(
        ArrowSource(corpus), tokenizer, 64, 2, block_size=4, num_epochs=1, drop_last=False
    )
    stream = [
        t
        for b in loader
        for row, lens in zip(b.input_ids, b.doc_lens, strict=True)
        for t in row[: lens.sum()].tolist()
    ]
    assert 1 not in stream  # no pad id packed
    assert len(stream) == sum(map(len, whole)) + len(texts)  # every id, and one EOS each


def test_special_token_strings_in_a_document_encode_as_text(tmp_path):
    docs = ["first <|endoftext|> mentions <|begin_of_text|> literally", "second doc"]
    model = _byte_level_bpe(docs * 20, ["<|begin_of_text|>", "<|endoftext|>"])
    model.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    ids = tokenizer.encode(docs[0])
    assert 0 not in ids and 1 not in ids
    assert tokenizer.decode(ids) == docs[0]
    import pyarrow as pa

    table = pa.table({"text": docs})
    with pa.ipc.new_file(tmp_path / "docs.arrow", table.schema) as writer:
        writer.write_table(table)
    loader = PackedLoader(
        ArrowSource(tmp_path / "docs.arrow"), tokenizer, 256, 1, shuffle=False, block_size=1,
        num_epochs=1, drop_last=False, add_bos=True,
    )  # fmt: skip
    (batch,) = list(loader)
    lens = batch.doc_lens[0][batch.doc_lens[0] > 0]
    real = batch.input_ids[0][: lens.sum()]
    # BOS and EOS only where the loader puts them: around each document
    assert np.flatnonzero(real == 0).tolist() == [0, int(lens[0])]
    assert np.flatnonzero(real == 1).tolist() == [int(lens[0]) - 1, int(lens.sum()) - 1]


def test_a_file_that_is_not_a_model_is_an_error(tmp_path):
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match=r"bad\.model is not a SentencePiece model"):
        Tokenizer.from_file(tmp_path / "bad.model")


def test_loader_without_an_eos_token_is_an_error(tmp_path, corpus):
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")
    )
    model.save(str(tmp_path / "plain.json"))
    with pytest.raises(
        DataError, match=r"tokenizer plain\.json has no EOS token; pass eos_token= to Tokenizer"
    ):
        PackedLoader(
            ArrowSource(corpus), Tokenizer.from_file(tmp_path / "plain.json"), 64, 2, block_size=4
        )


def test_special_token_names_for_a_sentencepiece_model_are_refused(tokenizer_path):
    for named in (dict(eos_token="</s>"), dict(bos_token="<s>")):
        with pytest.raises(DataError, match=r"a SentencePiece model carries its own ids"):
            Tokenizer.from_file(tokenizer_path, **named)


def test_trained_tokenizer_keeps_code_layout_exactly(tokenizer_path):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_path))
    code = "def f(x):\n    if x:\n\t\treturn  x  # two  spaces\n\n    return 12345\n"
    assert sp.decode(sp.encode(code)) == code
    assert all(sum(c.isdigit() for c in piece) <= 1 for piece in sp.encode_as_pieces("x = 12345"))


def test_json_lines_train_on_their_text_field_as_the_same_documents_in_arrow(
    tmp_path, documents, arrow_writer
):
    import gzip
    import json

    import sentencepiece

    from hlat_data import train_tokenizer

    texts = [*documents[:20], None, *documents[20:30]]  # a null text is skipped by both
    lines = b"".join(json.dumps({"id": i, "text": t}).encode() + b"\n" for i, t in enumerate(texts))
    (tmp_path / "docs.jsonl").write_bytes(lines)
    (tmp_path / "docs.jsonl.gz").write_bytes(gzip.compress(lines))
    arrow = arrow_writer(tmp_path / "docs.arrow", texts)
    vocabularies = {}
    for name in ("docs.jsonl", "docs.jsonl.gz", arrow.name):
        path = train_tokenizer(
            str(tmp_path / name), tmp_path / name.replace(".", "_"), 400, num_threads=1
        )
        model = sentencepiece.SentencePieceProcessor(model_file=path)
        vocabularies[name] = [
            (model.id_to_piece(i), model.get_score(i)) for i in range(model.get_piece_size())
        ]
    assert vocabularies["docs.jsonl"] == vocabularies["docs.arrow"]
    assert vocabularies["docs.jsonl.gz"] == vocabularies["docs.arrow"]
    with pytest.raises(DataError, match=r"no text to train on .*31 bad records.*'body'"):
        train_tokenizer(str(tmp_path / "docs.jsonl"), tmp_path / "x", 400, text_column="body")
    (tmp_path / "notes.txt.gz").write_bytes(gzip.compress(b"some notes"))
    with pytest.raises(DataError, match=r"notes\.txt\.gz: not UTF-8 text .*JSON lines"):
        train_tokenizer(str(tmp_path / "notes.txt.gz"), tmp_path / "x", 400)


def test_train_tokenizer_creates_the_output_directory_and_refuses_a_url(tmp_path, documents):
    from hlat_data import train_tokenizer

    (tmp_path / "train.txt").write_text("\n".join(documents))
    output = tmp_path / "new" / "deeper" / "sp"
    path = train_tokenizer(str(tmp_path / "train.txt"), output, 400, num_threads=1)
    assert path == f"{output}.model"
    assert Tokenizer.from_file(path).vocab_size <= 400
    with pytest.raises(DataError, match=r"writes the model to a local path, got s3://b/sp"):
        train_tokenizer(str(tmp_path / "missing.txt"), "s3://b/sp.model", 400)
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match=r"cannot create the directory of .*file/sp"):
        train_tokenizer(str(tmp_path / "train.txt"), tmp_path / "file" / "sp", 400)


def test_train_tokenizer_takes_a_glob_of_text_files_as_their_list(tmp_path, documents):
    from hlat_data import train_tokenizer

    texts = tmp_path / "texts"
    texts.mkdir()
    half = len(documents) // 2
    (texts / "a.txt").write_text("\n".join(documents[:half]))
    (texts / "b.txt").write_text("\n".join(documents[half:]))
    listed = train_tokenizer(
        [str(texts / "a.txt"), str(texts / "b.txt")], tmp_path / "listed", 400, num_threads=1
    )
    globbed = train_tokenizer(str(texts / "*.txt"), tmp_path / "globbed", 400, num_threads=1)
    a, b = Tokenizer.from_file(listed), Tokenizer.from_file(globbed)
    assert a.vocab_size == b.vocab_size
    assert a.encode_batch(documents) == b.encode_batch(documents)
    with pytest.raises(DataError, match=r"\*\.md: the pattern matches no files"):
        train_tokenizer(str(texts / "*.md"), tmp_path / "none", 400)


def test_a_glob_reads_each_file_it_matches_by_the_file_s_own_name(
    tmp_path, documents, arrow_writer
):
    """A pattern without a suffix (``part-*``, ``data-*``) reads JSON lines, Arrow and text
    files each as such, as the list of the files it matches does."""
    import json

    import sentencepiece

    from hlat_data import train_tokenizer

    lines = "".join(json.dumps({"text": d}) + "\n" for d in documents[:30])
    for folder in ("jdir", "mixed"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "part-0.jsonl").write_text(lines[: len(lines) // 2 + 1])
        (tmp_path / folder / "part-1.jsonl").write_text(lines[len(lines) // 2 + 1 :])
    arrow_writer(tmp_path / "mixed" / "part-2.arrow", documents[30:], stream=True)
    (tmp_path / "mixed" / "part-3.txt").write_text("\n".join(documents[:10]))

    def vocabulary(inputs: str | list[str], name: str) -> list[tuple[str, float]]:
        path = train_tokenizer(inputs, tmp_path / name, 400, num_threads=1)
        model = sentencepiece.SentencePieceProcessor(model_file=path)
        return [(model.id_to_piece(i), model.get_score(i)) for i in range(model.get_piece_size())]

    for folder in ("jdir", "mixed"):
        files = sorted(str(p) for p in (tmp_path / folder).iterdir())
        globbed = vocabulary(str(tmp_path / folder / "part-*"), f"{folder}_globbed")
        assert globbed == vocabulary(files, f"{folder}_listed"), folder
    assert not any('"text"' in piece for piece, _ in globbed)  # JSON read as JSON, not text


# "€abcd" is 7 bytes: 4 x 5000 bytes end on the euro sign's first byte
@pytest.mark.parametrize("word", ["hello world, this is text. ", "€abcd"])
def test_max_chars_bounds_what_one_large_text_file_feeds(tmp_path, monkeypatch, word):
    """A text file is one document: ``max_chars`` cuts it, and no more than 4 bytes per
    character is read (a character that limit cuts, of the euro sign's 3 bytes, is left out,
    not an error)."""
    import sentencepiece

    from hlat_data import train_tokenizer

    fed = []
    train = sentencepiece.SentencePieceTrainer.train

    def counting(**kwargs):
        pieces = list(kwargs.pop("sentence_iterator"))
        fed.append(sum(map(len, pieces)))
        return train(sentence_iterator=iter(pieces), **kwargs)

    monkeypatch.setattr(sentencepiece.SentencePieceTrainer, "train", counting)
    (tmp_path / "big.txt").write_text(word * 4000, encoding="utf-8")
    train_tokenizer(str(tmp_path / "big.txt"), tmp_path / "sp", 400, max_chars=5000)
    assert fed == [5000]


def test_train_tokenizer_reads_a_remote_directory_as_a_local_one(tmp_path, documents, s3_bucket):
    import json

    import fsspec
    import sentencepiece

    from hlat_data import train_tokenizer

    url, options = s3_bucket
    lines = b"".join(json.dumps({"text": d}).encode() + b"\n" for d in documents)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.jsonl").write_bytes(lines)
    fsspec.filesystem("s3", **options).pipe(f"{url}/dir/a.jsonl", lines)
    vocabularies = []
    for entry, name in ((str(tmp_path / "dir"), "local"), (f"{url}/dir/", "remote")):
        path = train_tokenizer(entry, tmp_path / name, 400, num_threads=1, storage_options=options)
        model = sentencepiece.SentencePieceProcessor(model_file=path)
        vocabularies.append([model.id_to_piece(i) for i in range(model.get_piece_size())])
    assert vocabularies[0] == vocabularies[1]


def test_encoding_threads_default_to_the_cores_shared_by_the_node_s_processes(monkeypatch):
    from hlat_data import default_threads
    from hlat_data.tokenizer import usable_cores

    cores = usable_cores()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_threads() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_threads() == max(1, cores // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 32))  # more ranks than cores
    assert default_threads() == 1


def test_a_tokenizer_takes_the_default_unless_told(tokenizer_path, monkeypatch):
    from hlat_data import Tokenizer, default_threads

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Tokenizer.from_file(tokenizer_path).num_threads == default_threads()
    assert Tokenizer.from_file(tokenizer_path, num_threads=3).num_threads == 3


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
HARD_TEXT = "naïve café — 東京 🙂👍🏽 \x00\x07\tx = 12345\r\n\n  'll SHOUTING's end"


def _llama3_style(documents, specials, template):
    """A byte-level BPE behind Llama 3's regex split, with a post-processor template."""
    tokenizers = pytest.importorskip("tokenizers")
    pre = tokenizers.pre_tokenizers
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    model.pre_tokenizer = pre.Sequence(
        [
            pre.Split(tokenizers.Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=pre.ByteLevel.alphabet()
    )
    model.train_from_iterator([d for d in documents if d], trainer)
    model.post_processor = tokenizers.processors.Sequence(
        [
            tokenizers.processors.ByteLevel(trim_offsets=False),
            tokenizers.processors.TemplateProcessing(
                single=template, special_tokens=[(t, model.token_to_id(t)) for t in specials]
            ),
        ]
    )
    return model


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("pre_tokenizer", ["byte-level", "llama3-regex"])
def test_hugging_face_byte_level_tokenizers_pack_exactly(
    tmp_path, documents, pre_tokenizer, workers
):
    """The loader's ids are the library's own encode (no special tokens), for non-ASCII,
    emoji, control characters and digit runs, behind either pre-tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    if pre_tokenizer == "llama3-regex":
        model = _llama3_style(documents, specials, "<|begin_of_text|> $A")
    else:
        model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
        model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = tokenizers.decoders.ByteLevel()
        model.train_from_iterator(
            [d for d in documents if d],
            tokenizers.trainers.BpeTrainer(
                vocab_size=420,
                special_tokens=specials,
                initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            ),
        )
    model.save(str(tmp_path / "tokenizer.json"))
    texts = [HARD_TEXT, *[d for d in documents if d][:6], "🙂" * 5, " leading space"]
    path = tmp_path / "texts.arrow"
    import pyarrow as pa

    table = pa.table({"text": texts})
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    loader = PackedLoader(
        ArrowSource(path), tokenizer, 64, 1, shuffle=False, block_size=1, num_epochs=1,
        drop_last=False, num_workers=workers, chunk_docs=2,
    )  # fmt: skip
    stream = [t for b in loader for t in b.input_ids[0][: b.doc_lens[0].sum()].tolist()]
    expected = []
    for text in texts:
        expected += [*model.encode(text, add_special_tokens=False).ids, 1]
    assert stream == expected
    assert model.decode(model.encode(HARD_TEXT, add_special_tokens=False).ids) == HARD_TEXT


def test_bos_and_eos_come_from_the_post_processor_unless_named(tmp_path, documents):
    model = _llama3_style(documents, ["[START]", "[STOP]", "</s>"], "[START] $A [STOP]")
    model.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json")
    # the template's tokens, not the known name </s> the vocabulary also has
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    named = Tokenizer.from_file(tmp_path / "tokenizer.json", eos_token="</s>")
    assert (named.bos_id, named.eos_id) == (0, 2)
    # each special id is part of the fingerprint: a loader state refuses another BOS
    other_bos = Tokenizer.from_file(tmp_path / "tokenizer.json", bos_token="[STOP]")
    assert other_bos.bos_id == 1
    assert other_bos.fingerprint()["bos_id"] != tokenizer.fingerprint()["bos_id"]
    assert named.fingerprint()["eos_id"] != tokenizer.fingerprint()["eos_id"]
    llama3 = _llama3_style(
        documents, ["<|begin_of_text|>", "<|end_of_text|>"], "<|begin_of_text|> $A"
    )
    llama3.save(str(tmp_path / "llama3.json"))
    # the template adds BOS only; EOS is the known name
    assert (Tokenizer.from_file(tmp_path / "llama3.json").bos_id,) == (0,)
    assert Tokenizer.from_file(tmp_path / "llama3.json").eos_id == 1
