from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hlat_data import ArrowSource, DataError
from hlat_data.source import split_text


def test_random_access_across_record_batches_returns_each_document(corpus, documents):
    source = ArrowSource(corpus)
    assert len(source) == len(documents)
    order = np.random.default_rng(0).permutation(len(documents))
    assert source.texts(order) == [documents[i] for i in order]


@pytest.mark.parametrize("layout", ["file", "stream", "parquet", "save_to_disk", "glob", "list"])
def test_every_layout_reads_the_same_documents(arrow_writer, tmp_path, documents, layout):
    half = len(documents) // 2
    if layout == "file":
        target = str(arrow_writer(tmp_path / "a.arrow", documents))
    elif layout == "stream":
        target = str(arrow_writer(tmp_path / "a.arrow", documents, stream=True))
    elif layout == "parquet":
        pq.write_table(pa.table({"text": documents}), tmp_path / "a.parquet", row_group_size=6)
        target = str(tmp_path / "a.parquet")
    elif layout == "save_to_disk":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict({"text": documents}).save_to_disk(tmp_path / "ds", num_shards=3)
        target = str(tmp_path / "ds")
    elif layout == "glob":
        arrow_writer(tmp_path / "part-0.arrow", documents[:half])
        arrow_writer(tmp_path / "part-1.arrow", documents[half:], stream=True)
        target = str(tmp_path / "part-*.arrow")
    else:
        pq.write_table(pa.table({"text": documents[:half]}), tmp_path / "a.parquet")
        arrow_writer(tmp_path / "b.arrow", documents[half:])
        target = [str(tmp_path / "a.parquet"), str(tmp_path / "b.arrow")]
    source = ArrowSource(target)
    assert source.texts(range(len(source))) == documents


def test_long_documents_are_cut_before_a_space_that_follows_a_non_space():
    text = ("word " * 50 + "\n") * 40
    pieces = split_text(text, 300)
    assert "".join(pieces) == text
    assert all(0 < len(p) <= 300 for p in pieces)
    assert all(p[-1] != " " and n[0] == " " for p, n in itertools.pairwise(pieces))
    # the last such point in the window, however far back; exactly at max_chars if none
    assert split_text("a" + " " * 500, 300) == ["a", " " * 300, " " * 200]
    assert split_text("ab " + "x" * 400, 300) == ["ab", " " + "x" * 299, "x" * 101]
    assert split_text("x" * 1000, 300) == ["x" * 300] * 3 + ["x" * 100]
    spaced = "a\u2581 b" * 100  # a space after ``▁`` is after a space
    assert split_text(spaced, 300) == [spaced[:300], spaced[300:]]


def test_source_splits_documents_over_max_chars(arrow_writer, tmp_path):
    path = arrow_writer(tmp_path / "a.arrow", ["a " * 600, "", "short"])
    assert ArrowSource(path, max_chars=500).documents([0, 1, 2]) == [
        split_text("a " * 600, 500),
        [],
        ["short"],
    ]


def test_same_files_locally_and_on_s3_have_the_same_fingerprint_and_texts(
    tmp_path, corpus, documents, s3_bucket
):
    import fsspec

    url, options = s3_bucket
    fs = fsspec.filesystem("s3", **options)
    fs.put(str(corpus), f"{url}/corpus.arrow")
    remote = ArrowSource(f"{url}/corpus.arrow", storage_options=options)
    local = ArrowSource(corpus)
    assert remote.fingerprint() == local.fingerprint()
    assert remote.texts([40, 3, 17]) == [documents[i] for i in (40, 3, 17)]
    assert remote.files == [f"{url}/corpus.arrow"]


@pytest.mark.parametrize("stream", [False, True])
def test_opening_a_remote_file_reads_metadata_not_record_batches(
    arrow_writer, tmp_path, s3_bucket, caplog, stream
):
    import logging

    import fsspec

    url, options = s3_bucket
    fs = fsspec.filesystem("s3", **options)
    texts = [f"document {i} " + "x" * 200_000 for i in range(40)]  # ~8 MB in 8 record batches
    path = arrow_writer(tmp_path / "big.arrow", texts, stream=stream)
    fs.put(str(path), f"{url}/big.arrow")
    with caplog.at_level(logging.DEBUG, logger="s3fs"):
        source = ArrowSource(f"{url}/big.arrow", storage_options=options)
    fetched = 0
    for record in caplog.records:
        if record.getMessage().startswith("Fetch: "):
            start, end = record.args[-2:]
            fetched += end - start
    assert len(source) == 40
    assert 0 < fetched < path.stat().st_size / 4, (fetched, path.stat().st_size)
    assert source.text(37) == texts[37]


def test_arrow_files_of_the_format_before_0_15_are_read(tmp_path, documents):
    path = tmp_path / "legacy.arrow"
    batch = pa.record_batch([pa.array(documents[:12])], names=["text"])
    options = pa.ipc.IpcWriteOptions(use_legacy_format=True)
    with pa.ipc.new_stream(path, batch.schema, options=options) as writer:
        writer.write_batch(batch.slice(0, 5))
        writer.write_batch(batch.slice(5))
    assert ArrowSource(path).texts(range(12)) == documents[:12]


@pytest.mark.parametrize("layout", ["file", "stream", "parquet"])
def test_a_dictionary_encoded_text_column_is_read_as_its_strings(tmp_path, documents, layout):
    """A categorical text column (and another one beside it) reads as the plain strings, also
    past a dictionary batch that extends (file) or replaces (stream) the first one."""
    half = len(documents) // 2

    def batch(texts: list[str], dictionary: list[str]) -> pa.RecordBatch:
        """``texts``, the last values of ``dictionary``, dictionary-encoded."""
        indices = pa.array(range(len(dictionary) - len(texts), len(dictionary)), pa.int32())
        langs = pa.array(["en", "fr"] * len(texts))[: len(texts)]
        return pa.record_batch(
            [pa.DictionaryArray.from_arrays(indices, dictionary), langs.dictionary_encode()],
            names=["text", "lang"],
        )

    # the second batch's dictionary: the first one extended (file) or a new one (stream)
    first = batch(documents[:half], documents[:half])
    second = batch(documents[half:], documents if layout == "file" else documents[half:])
    if layout == "parquet":
        path = tmp_path / "dict.parquet"
        pq.write_table(pa.Table.from_batches([first, second]), path, row_group_size=7)
        assert pq.read_schema(path).field("text").type == first.schema.field("text").type
    else:
        path = tmp_path / "dict.arrow"
        opener = pa.ipc.new_stream if layout == "stream" else pa.ipc.new_file
        options = pa.ipc.IpcWriteOptions(emit_dictionary_deltas=layout == "file")
        with opener(path, first.schema, options=options) as writer:
            writer.write_table(pa.Table.from_batches([first]), max_chunksize=7)
            writer.write_batch(second)
    source = ArrowSource(path)
    order = np.random.default_rng(0).permutation(len(documents))
    assert source.texts(order) == [documents[i] for i in order]


def test_a_column_that_is_not_text_is_an_error_naming_the_column_to_pass(tmp_path):
    path = tmp_path / "ids.arrow"
    table = pa.table({"text": pa.array([1, 2]).dictionary_encode()})
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(DataError, match=r"ids\.arrow: column 'text' has type dictionary<") as e:
        ArrowSource(path)
    assert "text_column=" in str(e.value) and "convert" not in str(e.value)


def test_a_damaged_file_footer_is_an_error_naming_the_file(tmp_path, corpus):
    path = tmp_path / "footer.arrow"
    data = bytearray(corpus.read_bytes())
    (footer_size,) = struct.unpack("<i", data[-10:-6])
    data[-10 - footer_size : -10 - footer_size + 64] = b"\xee" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"footer\.arrow.*(footer|truncated or corrupt)"):
        ArrowSource(path)


def test_a_corrupt_record_batch_is_an_error_naming_the_file_when_read(tmp_path):
    path = tmp_path / "damaged.arrow"
    batch = pa.record_batch([pa.array(["a" * 1000, "b" * 1000])], names=["text"])
    with pa.ipc.new_file(path, batch.schema) as writer:
        writer.write_batch(batch)
    data = bytearray(path.read_bytes())
    body = data.index(b"a" * 1000) - 16  # the offsets buffer in front of the characters
    data[body : body + 16] = b"\x7f" * 16
    path.write_bytes(bytes(data))
    source = ArrowSource(path)  # the index reads metadata only
    with pytest.raises(DataError, match=r"damaged\.arrow"):
        source.texts([0, 1])


def test_a_string_view_column_is_read_on_the_declared_oldest_pyarrow(tmp_path):
    """``pa.string_view`` (one of the text types, looked up at import) came with pyarrow 16."""
    path = tmp_path / "view.arrow"
    table = pa.table({"text": pa.array(["a", "b c"], pa.string_view())})
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    assert ArrowSource(path).texts([1, 0]) == ["b c", "a"]
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (floor,) = [d for d in project["project"]["dependencies"] if d.startswith("pyarrow")]
    assert floor.startswith("pyarrow>=") and int(floor[len("pyarrow>=") :].split(".")[0]) >= 16


# --- bad input ----------------------------------------------------------------------------


def test_truncated_arrow_file_is_an_error_naming_the_file(tmp_path, corpus):
    broken = tmp_path / "broken.arrow"
    data = corpus.read_bytes()
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"broken\.arrow.*truncated or corrupt"):
        ArrowSource(broken)


def test_truncated_arrow_stream_is_an_error_naming_the_file(arrow_writer, tmp_path, documents):
    path = arrow_writer(tmp_path / "s.arrow", documents, stream=True)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(DataError, match=r"s\.arrow.*truncated or corrupt"):
        ArrowSource(path)


def test_garbage_file_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "garbage.arrow"
    path.write_bytes(b"this is not arrow at all" * 10 + b"\xff\xff\xff\xff\x00\x00\x00\x00")
    with pytest.raises(DataError, match=r"garbage\.arrow"):
        ArrowSource(path)


def test_json_lines_or_text_given_as_arrow_is_an_error_saying_how_to_read_it(tmp_path):
    for name, text in (("docs.jsonl", '{"text": "a"}\n' * 20), ("notes.txt", "hi\n"), ("t", "{}")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(
            DataError, match=rf"{name}: not Arrow data .*JsonlSource or open_source"
        ):
            ArrowSource(path)


def test_corrupt_parquet_file_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"PAR1 definitely not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet.*Parquet"):
        ArrowSource(path)


def test_missing_column_names_the_file_and_the_columns_present(tmp_path):
    path = tmp_path / "a.arrow"
    table = pa.table({"content": ["x"]})
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(DataError, match=r"a\.arrow: no column 'text' \(columns: content\)"):
        ArrowSource(path)


def test_non_string_column_is_an_error(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    with pytest.raises(DataError, match=r"a\.parquet: column 'text' has type int64"):
        ArrowSource(path)


def test_null_text_is_an_error_naming_file_and_row(arrow_writer, tmp_path):
    path = arrow_writer(tmp_path / "n.arrow", ["a", "b", "c", None, "e"], batch_rows=2)
    source = ArrowSource(path)
    with pytest.raises(DataError, match=r"n\.arrow: row 3 has a null 'text'"):
        source.texts([2, 3])


def test_null_texts_read_as_empty_when_skipping(arrow_writer, tmp_path):
    path = arrow_writer(tmp_path / "n.arrow", ["a", None, "c"])
    assert ArrowSource(path, nulls="skip").texts([0, 1, 2]) == ["a", "", "c"]


def test_empty_corpus_is_an_error(arrow_writer, tmp_path):
    path = arrow_writer(tmp_path / "empty.arrow", [])
    with pytest.raises(DataError, match=r"corpus is empty.*empty\.arrow"):
        ArrowSource(path)


def test_missing_path_and_unmatched_glob_are_errors(tmp_path):
    with pytest.raises(DataError, match=r"nope\.arrow: no such file"):
        ArrowSource(tmp_path / "nope.arrow")
    with pytest.raises(DataError, match=r"matches no files"):
        ArrowSource(str(tmp_path / "*.arrow"))


def test_save_to_disk_directory_with_a_missing_shard_is_an_error(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "x.arrow"}]})
    )
    with pytest.raises(DataError, match=r"x\.arrow: no such file"):
        ArrowSource(tmp_path / "ds")
