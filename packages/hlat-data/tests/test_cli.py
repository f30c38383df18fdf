from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hlat_data import (
    ArrowSource,
    DataError,
    JsonlSource,
    PackedLoader,
    Tokenizer,
    convert_to_arrow,
    corpus_stats,
    open_source,
)
from hlat_data.cli import main


def test_convert_reads_jsonl_gzip_parquet_text_and_datasets_dirs_in_order(tmp_path, documents):
    datasets = pytest.importorskip("datasets")
    docs = [d for d in documents if d][:20]
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:5]))
    )
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[5:10])
    pq.write_table(pa.table({"text": docs[10:14]}), tmp_path / "c.parquet")
    (tmp_path / "d.txt").write_text(docs[14])
    datasets.Dataset.from_dict({"text": docs[15:20]}).save_to_disk(tmp_path / "e_ds")
    inputs = [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl.gz", "c.parquet", "d.txt", "e_ds")]
    counts = convert_to_arrow(inputs, tmp_path / "out.arrow", batch_rows=3)
    assert counts == {
        "files": 5,
        "documents": 20,
        "characters": sum(map(len, docs)),
        "nulls_skipped": 0,
    }
    assert ArrowSource(tmp_path / "out.arrow").texts(range(20)) == docs
    assert not (tmp_path / "out.arrow.tmp").exists()


def test_the_progress_bar_ends_at_the_documents_written(tmp_path, capsys):
    """The last, partial record batch counts too: 7 documents in batches of 3 end at 7."""
    pytest.importorskip("tqdm")
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(7)))
    counts = convert_to_arrow(str(path), tmp_path / "out.arrow", batch_rows=3, progress=True)
    assert counts["documents"] == 7
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert re.match(r"convert: 7(\.0+)? documents ", last), last


def test_a_dataset_dict_directory_is_refused_naming_its_splits(tmp_path, documents):
    """``DatasetDict.save_to_disk`` writes one directory per split: reading them all would
    put the held-out split into training, so every reader refuses it and names a split;
    the split's own directory reads as any ``save_to_disk`` directory."""
    datasets = pytest.importorskip("datasets")
    docs = [d for d in documents if d]
    splits = {"train": docs[:12], "test": docs[12:15]}
    datasets.DatasetDict(
        {name: datasets.Dataset.from_dict({"text": texts}) for name, texts in splits.items()}
    ).save_to_disk(tmp_path / "dd")
    refusal = r"dd: a DatasetDict saved by save_to_disk \(splits: train, test\); give .*dd/train"
    for read in (ArrowSource, open_source, lambda p: convert_to_arrow(p, tmp_path / "o.arrow")):
        with pytest.raises(DataError, match=refusal):
            read(str(tmp_path / "dd"))
    assert not (tmp_path / "o.arrow").exists()
    assert open_source(str(tmp_path / "dd" / "train")).texts(range(12)) == splits["train"]
    # below the directory given, or matched by a glob: refused too
    for entry in (tmp_path, tmp_path / "dd" / "*"):
        with pytest.raises(DataError, match=r"holds a DatasetDict saved by save_to_disk"):
            open_source(str(entry))


def test_datasets_metadata_files_are_not_read_as_json_lines(tmp_path, documents):
    """A directory of Parquet files with the ``dataset_info.json`` (or ``dataset_infos.json``)
    that ``datasets`` exports write beside them opens as its Parquet files."""
    docs = [d for d in documents if d][:6]
    pq.write_table(pa.table({"text": docs[:3]}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"text": docs[3:]}), tmp_path / "part-1.parquet")
    for name in ("dataset_info.json", "dataset_infos.json"):
        (tmp_path / name).write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    assert open_source(str(tmp_path)).texts(range(6)) == docs
    assert open_source(str(tmp_path / "*")).texts(range(6)) == docs  # a glob alike
    counts = convert_to_arrow(str(tmp_path), tmp_path / "out.arrow")
    assert counts["documents"] == 6


def test_convert_reads_every_compressed_json_lines_format_jsonl_source_reads(tmp_path, documents):
    zstandard = pytest.importorskip("zstandard")
    docs = [d for d in documents if d][:30]
    data = b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)
    pieces = [data[i : i + 5000] for i in range(0, len(data), 5000)]  # cut inside lines
    # zstd frames (as pzstd writes them) and gzip members with zero padding (as bgzip ends)
    (tmp_path / "a.jsonl.zst").write_bytes(b"".join(zstandard.compress(p) for p in pieces))
    (tmp_path / "b.ndjson.gz").write_bytes(
        b"".join(gzip.compress(p) for p in pieces) + gzip.compress(b"") + b"\0" * 8
    )
    (tmp_path / "c.json.zst").write_bytes(zstandard.compress(data))
    inputs = [str(tmp_path / n) for n in ("a.jsonl.zst", "b.ndjson.gz", "c.json.zst")]
    counts = convert_to_arrow(inputs, tmp_path / "out.arrow", batch_rows=7)
    assert counts["documents"] == 90
    assert ArrowSource(tmp_path / "out.arrow").texts(range(90)) == docs * 3


def test_convert_of_a_broken_json_line_names_file_and_line(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "ok"}\n{"text": "cut\n')
    with pytest.raises(DataError, match=r"x\.jsonl:2: not valid JSON"):
        convert_to_arrow(str(tmp_path / "x.jsonl"), tmp_path / "out.arrow")
    assert not (tmp_path / "out.arrow").exists()
    assert not (tmp_path / "out.arrow.tmp").exists()
    # a truncated compressed file: named, and nothing left either
    data = gzip.compress(b'{"text": "ok"}\n' * 100)
    (tmp_path / "y.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"y\.jsonl\.gz: the file ends inside the gzip member"):
        convert_to_arrow(str(tmp_path / "y.jsonl.gz"), tmp_path / "out.arrow")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl", "y.jsonl.gz"]


def test_convert_of_invalid_utf8_names_file_and_line(tmp_path):
    (tmp_path / "x.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"x\.jsonl:3: invalid UTF-8"):
        convert_to_arrow(str(tmp_path / "x.jsonl"), tmp_path / "out.arrow")
    (tmp_path / "y.txt").write_bytes(b"line one\nline two \xc3\x28\n")
    with pytest.raises(DataError, match=r"y\.txt:2: invalid UTF-8"):
        convert_to_arrow(str(tmp_path / "y.txt"), tmp_path / "out.arrow")


def test_convert_of_a_missing_or_non_string_field_is_an_error(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"content": "a"}\n')
    with pytest.raises(DataError, match=r"x\.jsonl:1: no field 'text'"):
        convert_to_arrow(str(tmp_path / "x.jsonl"), tmp_path / "out.arrow")
    (tmp_path / "y.jsonl").write_text('{"text": "a"}\n{"text": 5}\n')
    with pytest.raises(DataError, match=r"y\.jsonl:2: field 'text' is int"):
        convert_to_arrow(str(tmp_path / "y.jsonl"), tmp_path / "out.arrow")


def test_convert_reads_every_text_column_type_arrow_source_reads(tmp_path, documents):
    """string_view and dictionary-encoded (categorical) text columns, in Arrow and Parquet
    files: the same documents through convert as through ArrowSource."""
    docs = [d for d in documents if d][:12]
    columns = {
        "view": pa.array(docs, pa.string_view()),
        "dict": pa.array(docs).dictionary_encode(),
        "large_dict": pa.array(docs, pa.large_string()).dictionary_encode(),
    }
    for name, column in columns.items():
        table = pa.table({"text": column})
        pq.write_table(table, tmp_path / f"{name}.parquet", row_group_size=5)
        with pa.ipc.new_file(tmp_path / f"{name}.arrow", table.schema) as writer:
            writer.write_table(table, max_chunksize=5)
        for suffix in (".parquet", ".arrow"):
            path = tmp_path / f"{name}{suffix}"
            assert ArrowSource(path).texts(range(len(docs))) == docs, path.name
            convert_to_arrow(str(path), tmp_path / "out.arrow", batch_rows=4)
            assert ArrowSource(tmp_path / "out.arrow").texts(range(len(docs))) == docs, path.name
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ids.parquet")
    with pytest.raises(DataError, match=r"ids\.parquet: column 'text' has type int64, not text"):
        convert_to_arrow(str(tmp_path / "ids.parquet"), tmp_path / "out.arrow")


def test_convert_of_an_unpaired_surrogate_escape_names_file_and_line(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n{"text": "x\\ud800y"}\n')
    with pytest.raises(DataError, match=r"x\.jsonl:2: field 'text' holds an unpaired surrogate"):
        convert_to_arrow(str(tmp_path / "x.jsonl"), tmp_path / "out.arrow")
    convert = ["convert", str(tmp_path / "x.jsonl"), "-o", str(tmp_path / "out.arrow")]
    assert main([*convert, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hlat-data convert: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow"])
def test_a_null_text_is_an_error_in_every_format_unless_skipped(
    tmp_path, arrow_writer, capsys, kind
):
    texts = ["a", "b", None, "d"]
    path = tmp_path / f"x.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        where = r"x\.jsonl:3: field 'text' is null"
    elif kind == "parquet":
        pq.write_table(pa.table({"text": texts}), path, row_group_size=2)
        where = r"x\.parquet: row 2 has a null 'text'"
    else:
        arrow_writer(path, texts, batch_rows=2)
        where = r"x\.arrow: row 2 has a null 'text'"
    out = tmp_path / "out.arrow"
    with pytest.raises(DataError, match=where + r"; .*pass --nulls skip \(nulls='skip'\)"):
        convert_to_arrow(str(path), out)
    assert not out.exists() and not (tmp_path / "out.arrow.tmp").exists()
    counts = convert_to_arrow(str(path), out, nulls="skip")
    assert (counts["documents"], counts["nulls_skipped"]) == (3, 1)
    assert ArrowSource(out).texts(range(3)) == ["a", "b", "d"]
    with pytest.raises(DataError, match=r"nulls must be 'error' or 'skip', got 'drop'"):
        convert_to_arrow(str(path), out, nulls="drop")
    convert = ["convert", str(path), "-o", str(tmp_path / "cli.arrow"), "--no-progress"]
    assert main(convert) == 2
    assert "pass --nulls skip" in capsys.readouterr().err
    assert main([*convert, "--nulls", "skip"]) == 0
    assert json.loads(capsys.readouterr().out)["nulls_skipped"] == 1


def test_convert_and_train_tokenizer_read_json_lines_as_jsonl_source_does(
    tmp_path, documents, capsys
):
    docs = [d for d in documents if d][:12]
    bom = b"\xef\xbb\xbf"
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jsonl").write_bytes(
        bom + b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs[:6])
    )
    (folder / "sub" / "b.jsonl.gz").write_bytes(
        gzip.compress(bom + b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs[6:]))
    )
    (folder / "notes.txt").write_text("not a document")
    expected = JsonlSource(folder).texts(range(12))
    assert expected == docs
    for inputs in ([str(folder / "a.jsonl"), str(folder / "sub" / "b.jsonl.gz")], [str(folder)]):
        counts = convert_to_arrow(inputs, tmp_path / "out.arrow")
        assert counts["documents"] == 12
        assert ArrowSource(tmp_path / "out.arrow").texts(range(12)) == expected
    assert (
        main(["train-tokenizer", str(folder), "-o", str(tmp_path / "sp"), "--vocab-size", "500"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["vocab_size"] <= 500
    # a directory of both kinds names both
    pq.write_table(pa.table({"text": ["t"]}), folder / "c.parquet")
    with pytest.raises(DataError, match=r"holds JSON lines .* and Arrow/Parquet .*c\.parquet"):
        convert_to_arrow(str(folder), tmp_path / "out2.arrow")


def test_stats_counts_documents_characters_tokens_and_lengths(corpus, documents, tokenizer):
    stats = corpus_stats(ArrowSource(corpus), tokenizer)
    assert stats["documents"] == len(documents)
    assert stats["empty"] == 1
    assert stats["characters"] == sum(map(len, documents))
    assert stats["tokens"] == sum(len(tokenizer.encode(d)) for d in documents if d)
    assert sum(stats["histogram"].values()) == len(documents) - 1
    # one epoch of the loader (its defaults: an EOS after each document) reads
    # tokens_with_eos tokens
    loader = PackedLoader(
        ArrowSource(corpus), tokenizer, 64, 1, shuffle=False, num_epochs=1, drop_last=False
    )
    read = sum(int(batch.doc_lens.sum()) for batch in loader)
    assert stats["tokens_with_eos"] == read > stats["tokens"]


def test_command_line_converts_trains_a_tokenizer_and_reports_stats(tmp_path, documents, capsys):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in documents))
    out = tmp_path / "c.arrow"
    assert (
        main(
            [
                "convert",
                str(tmp_path / "in.jsonl"),
                "-o",
                str(out),
                "--text-field",
                "body",
                "--no-progress",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["documents"] == len(documents)
    assert (
        main(["train-tokenizer", str(out), "-o", str(tmp_path / "sp"), "--vocab-size", "400"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 400
    assert main(["stats", str(out), "--tokenizer", str(tmp_path / "sp.model")]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tokens"] == sum(
        len(t)
        for t in Tokenizer.from_file(tmp_path / "sp.model").encode_batch(
            [d for d in documents if d]
        )
    )


def test_a_negative_document_count_is_refused(corpus, capsys):
    with pytest.raises(DataError, match=r"max_documents must be 0 or more, got -1"):
        corpus_stats(ArrowSource(corpus), max_documents=-1)
    with pytest.raises(SystemExit) as exit_:
        main(["stats", str(corpus), "--max-documents", "-1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "hlat-data stats: error: argument --max-documents: must be 0 or more, got -1"
    assert main(["stats", str(corpus), "--max-documents", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["documents_read"] == 0


def test_a_record_batch_of_no_rows_and_a_plan_without_a_mixture_are_refused(
    corpus, tmp_path, capsys
):
    for rows in ("0", "-5"):
        with pytest.raises(SystemExit) as exit_:
            main(["convert", str(corpus), "-o", str(tmp_path / "o.arrow"), "--batch-rows", rows])
        assert exit_.value.code == 2
        assert "argument --batch-rows: must be" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"batch_rows must be an integer of 1 or more, got 0"):
        convert_to_arrow(str(corpus), tmp_path / "o.arrow", batch_rows=0)
    assert not list(tmp_path.iterdir())
    assert main(["stats", str(corpus), "--planned-tokens", "1000"]) == 2
    assert "--planned-tokens goes with --mixture" in capsys.readouterr().err


def test_command_line_reports_bad_input_in_one_line_with_status_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "hlat_data.cli", "stats", str(tmp_path / "missing.arrow")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"hlat-data stats: {tmp_path / 'missing.arrow'}: no such file or directory"
    )


def test_help_is_plain_text_and_every_option_has_help():
    from hlat_data.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"hlat-data {name} {action.option_strings or action.dest}"
        text = sub.format_help()
        assert "``" not in text and ":func:" not in text and ":class:" not in text, name
    assert "``" not in parser.format_help()
