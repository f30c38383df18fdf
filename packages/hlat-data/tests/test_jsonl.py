from __future__ import annotations

import gzip
import itertools
import json
import pickle
import sys

import numpy as np
import pytest
from data_helpers import assert_same_batches, make_loader

from hlat_data import ArrowSource, DataError, JsonlSource, open_source
from hlat_data.cli import main

zstandard = pytest.importorskip("zstandard")

EXTRA = ["naïve café — 日本語のテキスト 😀🎉 ", "emoji only: 🦀🐍🚀", "ünïcödé\nover\nlines\t✓"]


def lines_of(texts, field="text") -> bytes:
    return b"".join(
        json.dumps({"id": i, field: t}, ensure_ascii=i % 2 == 0).encode() + b"\n"
        for i, t in enumerate(texts)
    )


def cut(data: bytes, size: int) -> list[bytes]:
    """``data`` in pieces of ``size`` bytes, cut anywhere (inside lines too, as bgzip does)."""
    return [data[i : i + size] for i in range(0, len(data), size)]


def write(path, data: bytes, fmt: str):
    if fmt == "gzip-members":  # several members, an empty end member, zero padding
        data = b"".join(gzip.compress(p) for p in cut(data, 700)) + gzip.compress(b"") + b"\0" * 8
    elif fmt == "gzip-single":
        data = gzip.compress(data)
    elif fmt == "zstd-frames":  # several frames, each after a skippable frame (as pzstd writes)
        compressor = zstandard.ZstdCompressor()
        skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"size"
        data = b"".join(skippable + compressor.compress(p) for p in cut(data, 700))
    path.write_bytes(data)
    return path


SUFFIX = {"plain": ".jsonl", "gzip-members": ".jsonl.gz", "gzip-single": ".jsonl.gz"}
SUFFIX["zstd-frames"] = ".jsonl.zst"
FORMATS = list(SUFFIX)


def write_corpus(tmp_path, texts, fmt="plain", name="corpus"):
    return write(tmp_path / f"{name}{SUFFIX[fmt]}", lines_of(texts), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_back_each_document_in_random_order(tmp_path, documents, fmt):
    texts = documents + EXTRA
    source = JsonlSource(write_corpus(tmp_path, texts, fmt))
    assert len(source) == len(texts)
    order = np.random.default_rng(1).permutation(len(texts))
    assert source.texts(order) == [texts[i] for i in order]
    if fmt in ("gzip-members", "zstd-frames"):
        assert len(source._members[0]) > 10  # random access per member
    copy = pickle.loads(pickle.dumps(source))  # as the loader's workers get it
    assert copy.texts([len(texts) - 1, 0, 20]) == [texts[-1], texts[0], texts[20]]
    assert copy.fingerprint() == source.fingerprint()


def test_blank_lines_crlf_and_a_byte_order_mark(tmp_path):
    data = b'\xef\xbb\xbf{"text": "a"}\r\n\n  \t\r\n{"text": "b"}\n\n{"text": "c"}'
    path = tmp_path / "x.jsonl"
    path.write_bytes(data)
    source = JsonlSource(path)
    assert source.texts(range(len(source))) == ["a", "b", "c"]
    path.write_bytes(data + b'\n\n{"text": 1}\n')
    with pytest.raises(DataError, match=r"x\.jsonl line 8: "):  # blank lines are counted
        JsonlSource(path).text(3)


def test_long_documents_are_split_into_pieces(tmp_path):
    source = JsonlSource(write_corpus(tmp_path, ["a " * 600, "", "short"]), max_chars=500)
    assert (
        source.documents([0, 1, 2])[0]
        == JsonlSource(write_corpus(tmp_path, ["a " * 600], name="one"), max_chars=500).documents(
            [0]
        )[0]
    )
    assert [len(d) for d in source.documents([0, 1, 2])] == [3, 0, 1]


@pytest.mark.parametrize("fmt", ["plain", "gzip-members"])
def test_loader_gives_the_same_batches_as_over_arrow_and_resumes_exactly(
    tmp_path, documents, tokenizer, corpus, fmt
):
    source = JsonlSource(write_corpus(tmp_path, documents, fmt))
    expected = list(itertools.islice(make_loader(ArrowSource(corpus), tokenizer), 40))
    loader = make_loader(source, tokenizer)
    head = list(itertools.islice(loader, 17))
    state = loader.state_dict()
    resumed = make_loader(JsonlSource(write_corpus(tmp_path, documents, fmt)), tokenizer)
    resumed.load_state_dict(state)
    tail = list(itertools.islice(resumed, 23))
    assert_same_batches(expected, head + tail)
    assert state["fingerprint"]["source"]["documents"] == len(documents)


def test_loader_with_a_worker_resumes_exactly(tmp_path, documents, tokenizer, corpus):
    source = JsonlSource(write_corpus(tmp_path, documents, "zstd-frames"))
    expected = list(itertools.islice(make_loader(ArrowSource(corpus), tokenizer), 30))
    loader = make_loader(source, tokenizer, num_workers=1)
    head = list(itertools.islice(loader, 11))
    resumed = make_loader(source, tokenizer, num_workers=1)
    resumed.load_state_dict(loader.state_dict())
    assert_same_batches(expected, head + list(itertools.islice(resumed, 19)))


BAD = [
    (b'{"text": "\xff\xfe"}', r"not valid UTF-8"),
    (b'{"text": "cut', r"not valid JSON"),
    (b'["text", "a list"]', r"not a JSON object but an array"),
    (b'{"id": 3, "body": "x"}', r'field "text" is missing \(keys: id, body\)'),
    (b'{"text": 42}', r'field "text" is a number, not a string'),
    (b'{"text": null}', r'field "text" is null'),
]


@pytest.mark.parametrize(("line", "what"), BAD, ids=[w.split()[-1] for _, w in BAD])
def test_a_bad_record_is_an_error_naming_file_and_line(tmp_path, line, what):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b'{"text": "a"}\n\n{"text": "b"}\n' + line + b'\n{"text": "c"}\n')
    source = JsonlSource(path)
    assert source.texts([0, 1]) == ["a", "b"]
    with pytest.raises(DataError, match=r"corpus\.jsonl line 4: " + what):
        source.texts([0, 2])
    texts, bad = JsonlSource(path, on_bad_record="skip").texts_with_bad([3, 2, 0])
    assert texts == ["c", "", "a"] and bad.tolist() == [1]


BAD_AT = [3, 11, 12, 30, 41, 47]


def write_bad_corpus(tmp_path, documents):
    """The documents with the bad records of ``BAD`` at ``BAD_AT`` (None in ``texts``)."""
    texts: list = list(documents)
    raw = [json.dumps({"text": t}).encode() for t in texts]
    for k, (line, _) in zip(BAD_AT, BAD, strict=True):
        raw[k] = line
        texts[k] = None
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(b"".join(gzip.compress(p) for p in cut(b"\n".join(raw) + b"\n", 900)))
    return path, texts


@pytest.mark.parametrize("workers", [0, 1])
def test_skipped_bad_records_are_counted_and_the_rest_all_arrive(
    tmp_path, documents, tokenizer, arrow_writer, workers, monkeypatch
):
    monkeypatch.setattr("hlat_data.loader.usable_cores", lambda: 1)  # the worker encodes
    path, texts = write_bad_corpus(tmp_path, documents)
    bad_at = BAD_AT
    source = JsonlSource(path, on_bad_record="skip")
    read, bad = source.texts_with_bad(range(len(texts)))
    assert read == [t or "" for t in texts] and bad.tolist() == bad_at
    # the same documents with nulls in their place, read by ArrowSource with the same policy
    arrow = ArrowSource(arrow_writer(tmp_path / "bad.arrow", texts), on_bad_record="skip")
    kwargs = dict(num_epochs=1, drop_last=False, chunk_docs=4)
    loader = make_loader(source, tokenizer, num_workers=workers, **kwargs)
    batches = list(loader)
    reference = make_loader(arrow, tokenizer, **kwargs)
    assert_same_batches(list(reference), batches)
    assert loader.bad_records == reference.bad_records == len(bad_at)
    assert loader.empty_documents == len(bad_at) + documents.count("")
    good = [t for t in texts if t]
    assert sum(int(b.doc_lens.sum()) for b in batches) == sum(
        len(tokenizer.encode(t)) + 1 for t in good
    )


def test_the_bad_record_count_travels_back_from_a_worker_process(tmp_path, documents, tokenizer):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from hlat_data.loader import _Encoder

    path, _ = write_bad_corpus(tmp_path, documents)
    encode = _Encoder(JsonlSource(path, on_bad_record="skip"), tokenizer, False, True)
    task = (0, 0, np.arange(10, 32), 0)  # holds BAD_AT's 11, 12 and 30
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        chunk = pool.submit(encode, task).result()
    assert chunk.bad == 3
    np.testing.assert_array_equal(chunk.tokens, encode(task).tokens)


def test_an_over_limit_member_is_a_clear_error_at_open(tmp_path, documents):
    path = write_corpus(tmp_path, documents, "gzip-single")
    assert JsonlSource(path).texts([5]) == [documents[5]]  # one member under the limit is fine
    with pytest.raises(DataError, match=r"corpus\.jsonl\.gz: the gzip member at byte 0 .*bgzip"):
        JsonlSource(path, max_member_bytes=4096)
    path = write(tmp_path / "one.jsonl.zst", zstandard.compress(lines_of(documents)), "plain")
    with pytest.raises(DataError, match=r"one\.jsonl\.zst: the zstd frame .*hlat-data convert"):
        JsonlSource(path, max_member_bytes=4096)


def test_damaged_and_truncated_compressed_files_are_errors_naming_the_file(tmp_path, documents):
    data = write_corpus(tmp_path, documents, "gzip-members").read_bytes()
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: the file ends inside the gzip member"):
        JsonlSource(tmp_path / "cut.jsonl.gz")
    (tmp_path / "plain.jsonl.gz").write_bytes(lines_of(documents))
    with pytest.raises(DataError, match=r"plain\.jsonl\.gz: .*cannot be decompressed"):
        JsonlSource(tmp_path / "plain.jsonl.gz")


def test_zst_without_zstandard_names_the_extra(tmp_path, documents, monkeypatch):
    path = write_corpus(tmp_path, documents, "zstd-frames")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(DataError, match=r"pip install hlat-data\[zstd\]"):
        JsonlSource(path)


def test_files_directories_and_globs(tmp_path, documents):
    folder = tmp_path / "d"
    folder.mkdir()
    write_corpus(folder, documents[:20], "plain", name="a")
    write_corpus(folder, documents[20:], "gzip-members", name="b")
    (folder / "notes.txt").write_text("not data")
    assert JsonlSource(folder).texts(range(len(documents))) == documents
    assert JsonlSource(str(folder / "*.jsonl*")).texts(range(len(documents))) == documents
    source = JsonlSource([folder / "b.jsonl.gz", folder / "a.jsonl"])
    assert source.texts([0, len(documents) - 1]) == [documents[20], documents[19]]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: the directory holds no JSON lines"):
        JsonlSource(tmp_path / "empty")
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        JsonlSource(tmp_path / "missing.jsonl")


def test_same_files_locally_and_on_s3_read_the_same(tmp_path, documents, s3_bucket, monkeypatch):
    import fsspec

    url, options = s3_bucket
    fs = fsspec.filesystem("s3", **options)
    texts = documents + EXTRA
    for fmt in ("plain", "gzip-members"):
        local = JsonlSource(write_corpus(tmp_path, texts, fmt))
        name = local.files[0].rsplit("/", 1)[-1]
        fs.put(local.files[0], f"{url}/{name}")
        remote = JsonlSource(f"{url}/{name}", storage_options=options)
        assert remote.files == [f"{url}/{name}"]
        assert remote.fingerprint() == local.fingerprint()
        ranges: list[int] = []

        def counting(paths, starts, ends, ranges=ranges, read=remote._files[0].fs.cat_ranges, **kw):
            ranges.append(len(paths))
            return read(paths, starts, ends, **kw)

        monkeypatch.setattr(remote._files[0].fs, "cat_ranges", counting)
        block = np.random.default_rng(2).permutation(np.arange(10, 42))
        assert remote.texts(block) == [texts[i] for i in block]
        assert ranges == [1]  # neighbouring documents in one ranged read
        monkeypatch.undo()


def test_open_source_picks_the_class_and_refuses_a_mix(tmp_path, documents, corpus):
    jsonl = write_corpus(tmp_path, documents, "plain")
    packed = write_corpus(tmp_path, documents, "zstd-frames")
    source = open_source([jsonl, str(packed)], on_bad_record="skip")
    assert isinstance(source, JsonlSource) and source.on_bad_record == "skip"
    assert len(source) == 2 * len(documents)
    assert isinstance(open_source(tmp_path), JsonlSource)  # a directory of JSON lines
    arrow = open_source(corpus, on_bad_record="skip")
    assert isinstance(arrow, ArrowSource) and arrow.nulls == "skip"
    with pytest.raises(DataError, match=r"a mix of JSON lines .*corpus\.jsonl.* and Arrow"):
        open_source([jsonl, corpus])
    (tmp_path / "more.arrow").write_bytes(corpus.read_bytes())
    with pytest.raises(DataError, match=r"a mix of JSON lines"):
        open_source(tmp_path)
    with pytest.raises(DataError, match=r"on_bad_record must be 'error' or 'skip'"):
        open_source(jsonl, on_bad_record="ignore")
    with pytest.raises(DataError, match=r"disagree"):
        ArrowSource(corpus, nulls="skip", on_bad_record="error")


def test_stats_command_reads_json_lines_and_counts_bad_records(tmp_path, documents, capsys):
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(gzip.compress(lines_of(documents[:10]) + b'{"text": 5}\n'))
    assert main(["stats", str(path)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["documents"] == 11 and stats["bad_records"] == 1
    assert stats["characters"] == sum(map(len, documents[:10]))
    assert main(["stats", str(path), "--on-bad-record", "error"]) == 2
    assert 'c.jsonl.gz line 11: field "text" is a number' in capsys.readouterr().err
