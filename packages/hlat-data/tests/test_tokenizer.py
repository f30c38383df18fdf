from __future__ import annotations

import pickle

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
    with pytest.raises(DataError, match=r"add_eos=True but tokenizer plain\.json has no EOS token"):
        PackedLoader(
            ArrowSource(corpus), Tokenizer.from_file(tmp_path / "plain.json"), 64, 2, block_size=4
        )


def test_trained_tokenizer_keeps_code_layout_exactly(tokenizer_path):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_path))
    code = "def f(x):\n    if x:\n\t\treturn  x  # two  spaces\n\n    return 12345\n"
    assert sp.decode(sp.encode(code)) == code
    assert all(sum(c.isdigit() for c in piece) <= 1 for piece in sp.encode_as_pieces("x = 12345"))


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
