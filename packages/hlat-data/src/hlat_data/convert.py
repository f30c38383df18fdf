"""Conversion of raw corpora to Arrow IPC files with a ``text`` column, and corpus statistics.

Conversion streams: it holds one output record batch at a time, so peak memory is bounded
by ``batch_bytes`` (plus one input line or one plain-text file), whatever the input size.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hlat_data.errors import DataError
from hlat_data.jsonl import (
    _BOM,
    _KIND,
    JSONL_SUFFIXES,
    _encodable,
    _kinds,
    compression,
    decompressed,
    is_jsonl,
)
from hlat_data.source import (
    ArrowSource,
    Source,
    _File,
    _resolve,
    data_files,
    is_text_type,
    text_type_error,
)
from hlat_data.tokenizer import Tokenizer

_TABLE_SUFFIXES = (".arrow", ".parquet", ".pq", ".ipc", ".feather")
_READ_BLOCK = 8 << 20  # stored bytes read per step from a compressed file


def convert_to_arrow(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    text_field: str = "text",
    batch_rows: int = 8192,
    batch_bytes: int = 32 << 20,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
    nulls: str = "error",
) -> dict[str, int]:
    """Write the documents of ``inputs`` to one Arrow IPC file with a ``text`` column.

    Args:
        inputs: files, globs or directories: JSON lines (``.jsonl``, ``.ndjson``, ``.json``,
            each plain, ``.gz`` or ``.zst`` as :class:`~hlat_data.JsonlSource` reads them, gzip
            members and zstd frames of any size; the document is field ``text_field`` of each
            line), Parquet and Arrow files and ``save_to_disk`` directories (column
            ``text_field``), and plain text files (any other suffix; one document per file).
            A directory stands for its JSON lines files, or else for its Arrow and Parquet
            files, as the sources read it.
        output: the Arrow file to write (written to ``<output>.tmp``, then renamed; removed
            when the conversion fails).
        batch_rows, batch_bytes: a record batch is written once either is reached; they
            bound memory and set the granularity of random access.
        progress: show a progress bar of documents written (needs ``tqdm``).
        nulls: a null text (JSON ``null``, an Arrow or Parquet null): ``"error"`` (the
            default, as the sources') stops naming file and line or row; ``"skip"`` leaves
            it out and counts it.

    Returns:
        ``{"files", "documents", "characters", "nulls_skipped"}``.

    Raises:
        DataError: naming file and line for broken JSON, invalid UTF-8, a missing or
            non-string field, a null text (``nulls="error"``); before anything is renamed
            into place.
    """
    if nulls not in ("error", "skip"):
        raise DataError(f"nulls must be 'error' or 'skip', got {nulls!r}")
    for name, value in (("batch_rows", batch_rows), ("batch_bytes", batch_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"{name} must be an integer of 1 or more, got {value!r}")
    entries = [inputs] if isinstance(inputs, str | os.PathLike) else list(inputs)
    options = storage_options or {}
    files = _expand([os.fspath(e) for e in entries], options)
    output = os.fspath(output)
    schema = pa.schema([pa.field("text", pa.string())])
    counts = {"files": len(files), "documents": 0, "characters": 0, "nulls_skipped": 0}
    bar = _progress(progress)
    fs, path = fsspec.core.url_to_fs(output, **options)
    try:
        with (
            fsspec.open(output + ".tmp", "wb", **options) as raw,
            pa.ipc.new_file(raw, schema) as writer,
        ):
            pending: list[str] = []
            size = 0
            for url in files:
                for text in _documents(url, text_field, options, nulls):
                    if text is None:
                        counts["nulls_skipped"] += 1
                        continue
                    pending.append(text)
                    size += len(text)
                    counts["documents"] += 1
                    counts["characters"] += len(text)
                    if len(pending) >= batch_rows or size >= batch_bytes:
                        writer.write_batch(
                            pa.record_batch([pa.array(pending, pa.string())], schema=schema)
                        )
                        if bar is not None:
                            bar.update(len(pending))
                        pending, size = [], 0
            if pending:
                writer.write_batch(pa.record_batch([pa.array(pending, pa.string())], schema=schema))
                if bar is not None:
                    bar.update(len(pending))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path + ".tmp")
        raise
    finally:
        if bar is not None:
            bar.close()
    fs.mv(path + ".tmp", path)
    return counts


def corpus_stats(
    source: Source,
    tokenizer: Tokenizer | None = None,
    *,
    max_documents: int | None = None,
) -> dict[str, Any]:
    """Documents, empty documents, characters and (with a tokenizer) tokens of a corpus,
    and a histogram of document lengths over power-of-two bins.

    With a tokenizer, ``tokens`` counts the documents' own tokens (``characters_per_token``
    divides by it) and ``tokens_with_eos`` adds the EOS that a loader with its defaults
    (``add_eos=True``, ``add_bos=False``) puts after each document that has tokens: what
    one epoch of the loader reads, and what a mixture's ``max_tokens`` counts.

    ``max_documents`` reads only the first that many documents (a quick look at a big
    corpus); the returned ``documents_read`` says how many were read. ``bad_records``
    counts the records a source with ``on_bad_record="skip"`` read as empty (they count in
    ``empty`` too).
    """
    if max_documents is not None and max_documents < 0:
        raise DataError(f"max_documents must be 0 or more, got {max_documents}")
    total = len(source) if max_documents is None else min(len(source), max_documents)
    lengths: list[np.ndarray] = []
    tokens = 0
    documents_with_tokens = 0
    bad = 0
    read = getattr(source, "texts_with_bad", None)
    for start in range(0, total, 1024):
        ids = range(start, min(start + 1024, total))
        if read is not None:
            texts, skipped = read(ids)
            bad += len(skipped)
        else:
            texts = source.texts(ids)
        lengths.append(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)))
        if tokenizer is not None:
            pieces = [t for t in texts if t]
            counts = [len(ids) for ids in tokenizer.encode_batch(pieces)] if pieces else []
            tokens += sum(counts)
            documents_with_tokens += sum(1 for n in counts if n)
    chars = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    bins = np.zeros(1, dtype=np.int64)
    nonzero = chars[chars > 0]
    if len(nonzero):
        bins = np.bincount(np.floor(np.log2(nonzero)).astype(np.int64))
    out: dict[str, Any] = {
        "documents": len(source),
        "documents_read": int(total),
        "empty": int((chars == 0).sum()),
        "bad_records": bad,
        "characters": int(chars.sum()),
        "histogram": {f"{1 << k}-{(2 << k) - 1}": int(n) for k, n in enumerate(bins) if n},
    }
    if tokenizer is not None:
        out["tokens"] = int(tokens)
        out["tokens_with_eos"] = int(tokens + documents_with_tokens)
        out["characters_per_token"] = round(out["characters"] / max(tokens, 1), 3)
    return out


def _expand(entries: list[str], options: dict[str, Any]) -> list[str]:
    """The inputs ``entries`` as files (and table directories), each to read as
    :func:`_input_kind` says: globs expanded, a directory of JSON lines as its files."""
    files: list[str] = []
    for entry in entries:
        fs, path = fsspec.core.url_to_fs(entry, **options)
        if any(c in path for c in "*?["):
            matches = data_files(entry, sorted(fs.glob(path)))
            if not matches:
                raise DataError(f"{entry}: the pattern matches no files")
            protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
            local = "file" in protocols
            files += [m if local else fs.unstrip_protocol(m) for m in matches]
        elif fs.isdir(path):
            kinds = dict(_kinds(entry, options))
            if len(kinds) > 1:
                raise DataError(
                    f"{entry}: the directory holds JSON lines ({kinds['jsonl']}) and Arrow/Parquet "
                    f"({kinds['table']}) files; give each kind as its own input (a glob)"
                )
            if "jsonl" in kinds:  # its JSON lines files, as JsonlSource reads the directory
                found = _resolve(entry, options, dir_suffixes=JSONL_SUFFIXES, dir_kind=_KIND)
                files += [f.url for f in found]
            else:
                files.append(entry)  # read as a table directory by ArrowSource
        elif fs.exists(path):
            files.append(entry)
        else:
            raise DataError(f"{entry}: no such file or directory")
    if not files:
        raise DataError("convert needs at least one input")
    return [os.path.abspath(f) if "://" not in f and "*" not in f else f for f in files]


def _input_kind(fs: Any, path: str) -> str:
    """How one input from :func:`_expand` is read: ``"jsonl"``, ``"parquet"``, ``"table"``
    (an Arrow file or a directory, through :class:`ArrowSource`) or ``"text"`` (one
    document); by its own name, whatever pattern matched it."""
    if is_jsonl(path):
        return "jsonl"
    if path.endswith((".parquet", ".pq")):
        return "parquet"
    if path.endswith(_TABLE_SUFFIXES) or fs.isdir(path):
        return "table"
    return "text"


def _null(what: str) -> DataError:
    return DataError(
        f"{what}; clean the data, or pass --nulls skip (nulls='skip') to leave null texts out"
    )


def _documents(url: str, field: str, options: dict[str, Any], nulls: str) -> Iterator[str | None]:
    """The texts of one input; None for a null text that ``nulls="skip"`` leaves out."""
    fs, path = fsspec.core.url_to_fs(url, **options)
    kind = _input_kind(fs, path)
    if kind == "jsonl":
        yield from _json_lines(url, field, options, nulls)
    elif kind == "parquet":
        with fs.open(path, "rb") as f:
            reader = pq.ParquetFile(f)
            _check_field(url, field, reader.schema_arrow)
            row = 0
            for batch in reader.iter_batches(columns=[field], batch_size=4096):
                for value in batch.column(0).to_pylist():
                    if value is None and nulls == "error":
                        raise _null(f"{url}: row {row} has a null {field!r}")
                    yield value
                    row += 1
    elif kind == "table":
        source = ArrowSource(url, text_column=field, storage_options=options, nulls="skip")
        for start in range(0, len(source), 4096):
            texts, bad = source.texts_with_bad(range(start, min(start + 4096, len(source))))
            if len(bad) and nulls == "error":
                raise _null(f"{source._where(start + int(bad[0]))} has a null {field!r}")
            skipped = set(bad.tolist())
            yield from (None if i in skipped else t for i, t in enumerate(texts))
    else:
        with fs.open(path, "rb") as f:
            data = f.read()
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise DataError(f"{url}:{line}: invalid UTF-8 ({e.reason} at byte {e.start})") from None


def _json_lines(url: str, field: str, options: dict[str, Any], nulls: str) -> Iterator[str | None]:
    with fsspec.open(url, "rb", **options) as f:
        fmt = compression(url)
        lines: Iterator[bytes] = iter(f) if fmt == "plain" else _lines(_text(url, fmt, f))
        for number, raw in enumerate(lines, start=1):
            if number == 1 and raw.startswith(_BOM):  # ignored, as JsonlSource does
                raw = raw[len(_BOM) :]
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{url}:{number}: invalid UTF-8 ({e.reason} at column {e.start + 1})"
                ) from None
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{url}:{number}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(record, dict) or field not in record:
                raise DataError(
                    f"{url}:{number}: no field {field!r} in this line; pass --text-field "
                    "(text_field=) to name the field holding the document"
                )
            text = record[field]
            if text is None:
                if nulls == "error":
                    raise _null(f"{url}:{number}: field {field!r} is null")
                yield None
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"{url}:{number}: field {field!r} is {type(text).__name__}, not a string"
                )
            if "\\u" in line and not _encodable(text):
                raise DataError(
                    f"{url}:{number}: field {field!r} holds an unpaired surrogate escape, not "
                    "Unicode text"
                )
            yield text


def _text(url: str, fmt: str, f: Any) -> Iterator[bytes]:
    """The decompressed text of the gzip or zstd file open as ``f``, a piece at a time, every
    member (frame) of it, as :class:`~hlat_data.JsonlSource` reads them."""
    file = _File(url, url, None, fmt, 0)

    def blocks() -> Iterator[np.ndarray]:
        while block := f.read(_READ_BLOCK):
            yield np.frombuffer(block, dtype=np.uint8)

    for _, text, _ in decompressed(file, blocks()):
        yield text


def _lines(pieces: Iterator[bytes]) -> Iterator[bytes]:
    """The lines of a byte stream that comes in pieces (newlines dropped)."""
    pending: list[bytes] = []  # the start of a line that runs on into the next piece
    for piece in pieces:
        lines = piece.split(b"\n")
        if len(lines) == 1:
            pending.append(piece)
            continue
        pending.append(lines[0])
        yield b"".join(pending)
        yield from lines[1:-1]
        pending = [lines[-1]]
    last = b"".join(pending)
    if last:
        yield last


def _check_field(url: str, field: str, schema: pa.Schema) -> None:
    if field not in schema.names:
        raise DataError(f"{url}: no column {field!r} (columns: {', '.join(schema.names)})")
    if not is_text_type(schema.field(field).type):
        raise text_type_error(
            url, field, schema.field(field).type, "pass --text-field (text_field=)"
        )


def _progress(enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(unit=" documents", desc="convert", unit_scale=True)
