"""Documents from Arrow IPC files, `datasets.save_to_disk` directories and Parquet files.

A source is a list of files, each cut into *parts* (Arrow record batches, Parquet row groups),
and a cumulative row offset per part, so document ``i`` is found with one binary search and
read from one part. Local files are memory-mapped; any other fsspec URL (``s3://`` through
s3fs) is read through ranged requests without copying the file to local disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hlat_data.errors import DataError

_FILE_MAGIC = b"ARROW1"
_STRING_TYPES = (pa.string(), pa.large_string(), pa.string_view())
"""The text types of a text column, also as the values of a dictionary-encoded one."""
_PARQUET_SUFFIXES = (".parquet", ".pq")
_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
_DATASETS_METADATA = frozenset(
    ("state.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json")
)
"""Names of the metadata files that ``datasets`` writes beside its data (``save_to_disk``,
``push_to_hub`` exports): never documents, whatever their suffix."""


def is_text_type(kind: pa.DataType) -> bool:
    """Whether a column of type ``kind`` holds text: a string type of ``_STRING_TYPES``, or a
    dictionary-encoded (categorical) column of one."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return kind in _STRING_TYPES


def text_type_error(url: str, column: str, kind: pa.DataType, how: str) -> DataError:
    """The error for a column ``column`` of type ``kind`` that is not text; ``how`` says how
    to name another column."""
    return DataError(
        f"{url}: column {column!r} has type {kind}, not text (string, large_string, "
        f"string_view, or a dictionary of one of them); {how} to name the column holding it"
    )


def decoded(column: Any) -> Any:
    """``column`` (an Arrow array or chunked array) with dictionary encoding undone."""
    if pa.types.is_dictionary(column.type):
        return column.cast(column.type.value_type)
    return column


def data_files(entry: str, paths: Iterable[str]) -> list[str]:
    """``paths`` (what a glob or a directory of ``entry`` lists) without the metadata files
    of ``datasets``; refuses a DatasetDict among them (see :func:`check_not_dataset_dict`)."""
    kept = []
    for p in paths:
        folder, _, name = p.rstrip("/").rpartition("/")
        if name == "dataset_dict.json":
            raise DataError(
                f"{entry}: holds a DatasetDict saved by save_to_disk ({folder}), whose splits "
                "would all be read; give the directory of one split"
            )
        if name not in _DATASETS_METADATA:
            kept.append(p)
    return kept


def check_not_dataset_dict(entry: str, fs: Any, path: str) -> None:
    """Refuses a directory that ``DatasetDict.save_to_disk`` wrote: its splits (train, test,
    ...) are directories of their own, and reading them all would mix held-out documents
    into training."""
    listing = f"{path.rstrip('/')}/dataset_dict.json"
    if not fs.exists(listing):
        return
    try:
        with fs.open(listing, "r") as f:
            splits = [str(s) for s in json.load(f).get("splits", [])]
    except (OSError, ValueError, AttributeError):
        splits = []
    named = ", ".join(splits) if splits else "its split directories"
    example = f"{entry.rstrip('/')}/{splits[0] if splits else 'train'}"
    raise DataError(
        f"{entry}: a DatasetDict saved by save_to_disk (splits: {named}); give the directory "
        f"of one split, e.g. {example}"
    )


_CONTINUATION = b"\xff\xff\xff\xff"
_RECORD_BATCH, _DICTIONARY_BATCH = 3, 2  # Arrow's MessageHeader union tags
_INDEX_BLOCK = 8 * 1024  # read-ahead while indexing a remote file: one metadata block
_OPEN_FILES = 64
"""Data files a source keeps open at once; the least recently read beyond this are closed."""


@dataclass(frozen=True)
class _File:
    url: str  # what the user sees in errors
    path: str  # path inside ``fs``
    fs: Any
    fmt: str  # "ipc" or "parquet"; for JsonlSource "plain", "gzip" or "zstd"
    size: int


@dataclass(frozen=True)
class _Part:
    file: int
    locator: int  # byte offset of the record-batch message, or the Parquet row-group index
    rows: int
    first_row: int  # row of the file where this part starts
    end: int = 0  # byte offset just past the record-batch message (Arrow IPC)


class Source(Protocol):
    """What :class:`~hlat_data.PackedLoader` reads: a numbered list of documents.

    :class:`ArrowSource` and :class:`~hlat_data.jsonl.JsonlSource` are sources. A source
    may also have ``documents_with_bad(indices)`` returning the documents and the
    positions in ``indices`` of bad records read as empty documents; the loader counts
    those in ``loader.bad_records``.
    """

    def __len__(self) -> int: ...

    @property
    def files(self) -> list[str]: ...

    def fingerprint(self) -> dict[str, Any]: ...

    def texts(self, indices: Iterable[int]) -> list[str]: ...

    def documents(self, indices: Iterable[int]) -> list[list[str]]: ...


def bad_record_policy(on_bad_record: str) -> str:
    """``on_bad_record`` checked: ``"error"`` or ``"skip"``."""
    if on_bad_record not in ("error", "skip"):
        raise DataError(f"on_bad_record must be 'error' or 'skip', got {on_bad_record!r}")
    return on_bad_record


# the last space after a non-space (SentencePiece's ``▁`` counts as a space) in the window
_LAST_CUT = re.compile("(?s:.*)[^ \u2581]( )")


def split_text(text: str, max_chars: int) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars`` characters that join back to it.

    Each cut is made before the last space that follows a non-space in the window, where a
    tokenizer can encode the pieces apart with the ids of the whole text
    (:meth:`~hlat_data.Tokenizer.encode_documents`; SentencePiece BPE with an identity
    normalizer, Llama's kind); a window without one is cut at ``max_chars``, and the
    tokenizer joins such pieces back before it encodes them.
    """
    if len(text) <= max_chars:
        return [text]
    pieces = []
    start = 0
    while len(text) - start > max_chars:
        end = start + max_chars
        found = _LAST_CUT.match(text, start, end + 1)
        cut = found.start(1) if found is not None else end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class _OpenFiles:
    """Open handles of a source's files by file index, at most ``_OPEN_FILES``: adding one
    more closes the least recently used, so a corpus of many files stays within the
    process's file descriptor limit."""

    def __init__(self) -> None:
        self._open: OrderedDict[int, Any] = OrderedDict()

    def get(self, index: int) -> Any:
        handle = self._open.get(index)
        if handle is not None:
            self._open.move_to_end(index)
        return handle

    def add(self, index: int, handle: Any) -> None:
        self._open[index] = handle
        while len(self._open) > _OPEN_FILES:
            _close(self._open.popitem(last=False)[1])

    def close(self, index: int) -> None:
        handle = self._open.pop(index, None)
        if handle is not None:
            _close(handle)


def _close(handle: Any) -> None:
    """Close a handle of :class:`_OpenFiles`. Arrow buffers already read from a memory map
    keep their mapping alive after it closes; a Python ``mmap`` still viewed by an array is
    unmapped, its descriptor closed, when the last view goes."""
    if isinstance(handle, pq.ParquetFile):
        handle.close(force=True)
    elif isinstance(handle, mmap.mmap):
        with contextlib.suppress(BufferError):
            handle.close()
    else:
        handle.close()


class FileSource:
    """What :class:`ArrowSource` and :class:`~hlat_data.JsonlSource` share: documents over
    indexed files (``_files``, the cumulative document counts ``_offsets``), read through
    the subclass's :meth:`texts_with_bad` and split at ``max_chars``; open handles and
    caches stay out of pickles (a worker opens its own)."""

    _files: list[_File]
    _offsets: np.ndarray
    max_chars: int

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def files(self) -> list[str]:
        """The data files, in the order their documents are numbered."""
        return [f.url for f in self._files]

    def _fingerprint(self, payload: list[Any], **named: Any) -> dict[str, Any]:
        """``fingerprint()`` of a corpus whose identity is ``payload`` (plain data); ``named``
        repeats settings the hash covers, so that a changed one is named."""
        return {
            "hash": hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16],
            "documents": len(self),
            "files": len(self._files),
            **named,
        }

    def _base_names(self) -> list[tuple[str, int]]:
        # Note: base names, so the same files read from a local disk and from ``s3://``
        # have the same fingerprint and a loader state moves between them
        return [(os.path.basename(f.path), f.size) for f in self._files]

    def texts_with_bad(self, indices: Iterable[int]) -> tuple[list[str], np.ndarray]:
        raise NotImplementedError

    def text(self, index: int) -> str:
        """Document ``index`` ("" for a record skipped as bad)."""
        return self.texts([index])[0]

    def texts(self, indices: Iterable[int]) -> list[str]:
        """The documents at ``indices``, in that order."""
        return self.texts_with_bad(indices)[0]

    def documents(self, indices: Iterable[int]) -> list[list[str]]:
        """The documents at ``indices`` split into pieces of at most ``max_chars``; an empty
        document (or a skipped bad record) is an empty list."""
        return self.documents_with_bad(indices)[0]

    def documents_with_bad(self, indices: Iterable[int]) -> tuple[list[list[str]], np.ndarray]:
        """:meth:`documents`, and the positions in ``indices`` of bad records read as empty."""
        texts, bad = self.texts_with_bad(indices)
        return [split_text(t, self.max_chars) if t else [] for t in texts], bad

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = _OpenFiles()
        state["_cache"] = OrderedDict()
        return state


class ArrowSource(FileSource):
    """A corpus of text documents with cheap random access to document ``i``.

    Args:
        paths_or_urls: a path or URL, or a list of them. Each may be an Arrow IPC file
            (file or stream format), a Parquet file, a directory written by
            ``datasets.Dataset.save_to_disk``, a directory of such files, or a glob.
            Local paths are memory-mapped; other fsspec URLs (``s3://...``) are streamed.
        text_column: the column holding the documents: ``string``, ``large_string`` or
            ``string_view``, or a dictionary-encoded (categorical) column of one of them.
        max_chars: documents longer than this are split into pieces (:func:`split_text`:
            before a space that follows a non-space where the window has one), still one
            document for packing, with the ids of the whole text: the tokenizer encodes the
            pieces apart only where that is proven exact (SentencePiece BPE with an identity
            normalizer, Llama's kind) and joins them back elsewhere
            (:meth:`~hlat_data.Tokenizer.encode_documents`).
        nulls: ``"error"`` (default) raises on a null text naming file and row; ``"skip"``
            treats nulls as empty documents (skipped and counted by the loader).
        storage_options: passed to fsspec for URLs (credentials, ``client_kwargs``).
        on_bad_record: the same as ``nulls`` (a null text is this format's bad record),
            under the name :class:`~hlat_data.jsonl.JsonlSource` and
            :func:`~hlat_data.open_source` take; give one of the two.

    Note:
        Opening a source reads only metadata: the few hundred bytes in front of each Arrow
        record batch (its row count and length; record batch bodies are skipped, so a
        remote file opens in one small ranged read per record batch, whatever its size,
        issued concurrently for the Arrow file format) or a Parquet footer. The index is pickled with the source, so loader workers never
        repeat it.
    """

    def __init__(
        self,
        paths_or_urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        text_column: str = "text",
        max_chars: int = 500_000,
        nulls: str | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        on_bad_record: str | None = None,
    ) -> None:
        if max_chars < 1:
            raise DataError(f"max_chars must be at least 1, got {max_chars}")
        if nulls is not None and nulls not in ("error", "skip"):
            raise DataError(f"nulls must be 'error' or 'skip', got {nulls!r}")
        if on_bad_record is not None:
            bad_record_policy(on_bad_record)
            if nulls is not None and nulls != on_bad_record:
                raise DataError(
                    f"nulls={nulls!r} and on_bad_record={on_bad_record!r} disagree; give one"
                )
            nulls = on_bad_record
        nulls = nulls or "error"
        entries = [paths_or_urls] if isinstance(paths_or_urls, str | os.PathLike) else paths_or_urls
        self.text_column = text_column
        self.max_chars = max_chars
        self.nulls = nulls
        self.on_bad_record = nulls
        self._files: list[_File] = []
        for entry in entries:
            self._files += _resolve(os.fspath(entry), storage_options or {})
        if not self._files:
            raise DataError(f"no data files given: {paths_or_urls!r}")
        self._parts: list[_Part] = []
        self._schemas: dict[int, pa.Schema] = {}
        # per file with dictionary batches: byte ranges of its schema message, then of those
        self._dictionaries: dict[int, list[tuple[int, int]]] = {}
        for index, file in enumerate(self._files):
            self._parts += self._index(index, file)
        rows = np.array([p.rows for p in self._parts], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(rows)])
        if self._offsets[-1] == 0:
            raise DataError(
                f"the corpus is empty: {len(self._files)} file(s) with no rows "
                f"({', '.join(f.url for f in self._files[:3])})"
            )
        self._handles = _OpenFiles()
        self._cache: OrderedDict[int, pa.Array] = OrderedDict()

    # --- public ---------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this corpus: file base names, sizes and row counts, column,
        split limit. The null policy is not part of it: it changes no document that
        ``"error"`` reads, so a run stopped by a null text resumes with ``"skip"``."""
        rows = [int(self._offsets[-1])]
        # Note: the hash keeps the default policy's value where the policy used to be, so
        # the states saved with it by earlier versions still load
        return self._fingerprint(
            [self._base_names(), rows, self.text_column, self.max_chars, "error"],
            text_column=self.text_column,
            max_chars=self.max_chars,
        )

    def texts_with_bad(self, indices: Iterable[int]) -> tuple[list[str], np.ndarray]:
        """The documents at ``indices``, and the positions in ``indices`` of those that were
        null (read as ``""``; none unless ``nulls="skip"``)."""
        ids = np.asarray(list(indices) if not isinstance(indices, np.ndarray) else indices)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"document index out of range 0..{len(self) - 1}")
        parts = np.searchsorted(self._offsets, ids, side="right") - 1
        out = []
        bad = []
        for position, (index, part) in enumerate(zip(ids.tolist(), parts.tolist(), strict=True)):
            value = self._part(part)[index - int(self._offsets[part])].as_py()
            if value is None:
                bad.append(position)
            out.append("" if value is None else value)
        return out, np.array(bad, dtype=np.int64)

    def __repr__(self) -> str:
        return f"ArrowSource({len(self)} documents in {len(self._files)} file(s), column {self.text_column!r})"

    # --- internals ------------------------------------------------------------------------

    def _open(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            file = self._files[index]
            handle = _open(file)
            if file.fmt == "parquet":
                handle = pq.ParquetFile(handle)
            self._handles.add(index, handle)
        return handle

    def _where(self, index: int) -> str:
        """Document ``index`` as ``"<file>: row <row of the file>"``."""
        part = int(np.searchsorted(self._offsets, index, side="right")) - 1
        found = self._parts[part]
        row = found.first_row + index - int(self._offsets[part])
        return f"{self._files[found.file].url}: row {row}"

    def _check_schema(self, file: _File, schema: pa.Schema) -> None:
        if self.text_column not in schema.names:
            raise DataError(
                f"{file.url}: no column {self.text_column!r} (columns: "
                f"{', '.join(schema.names) or 'none'}); pass text_column= to ArrowSource"
            )
        kind = schema.field(self.text_column).type
        if not is_text_type(kind):
            raise text_type_error(file.url, self.text_column, kind, "pass text_column=")

    def _index(self, index: int, file: _File) -> list[_Part]:
        try:
            handle = _open(file, block_size=_INDEX_BLOCK)
        except FileNotFoundError:
            raise DataError(f"{file.url}: no such file") from None
        try:
            if file.fmt == "parquet":
                try:
                    reader = pq.ParquetFile(handle)
                except (pa.ArrowException, OSError) as e:
                    raise DataError(
                        f"{file.url}: not a readable Parquet file ({e}); rewrite it"
                    ) from None
                self._check_schema(file, reader.schema_arrow)
                parts: list[_Part] = []
                first = 0
                for group in range(reader.metadata.num_row_groups):
                    rows = reader.metadata.row_group(group).num_rows
                    parts.append(_Part(index, group, rows, first))
                    first += rows
                return parts
            return self._index_ipc(index, file, handle)
        finally:
            handle.close()

    def _index_ipc(self, index: int, file: _File, handle: Any) -> list[_Part]:
        def corrupt(what: str, error: Exception | None = None) -> DataError:
            detail = f" ({error})" if error else ""
            return DataError(
                f"{file.url}: {what}{detail}; the file is truncated or corrupt: write it again "
                "(hlat-data convert writes Arrow files)"
            )

        head = handle.read(8)
        is_file_format = head[:6] == _FILE_MAGIC
        # an Arrow stream begins with a continuation marker, or (before Arrow 0.15) the
        # little-endian length of its schema message; text begins with neither
        if head and not is_file_format and head[:4] != _CONTINUATION and head[3:4] != b"\0":
            raise DataError(
                f"{file.url}: not Arrow data (it starts with {bytes(head[:8])!r}); JSON lines "
                "read through JsonlSource or open_source, text and other formats through "
                "hlat-data convert"
            )
        if is_file_format:
            handle.seek(file.size - 6)
            if handle.read(6) != _FILE_MAGIC:
                raise corrupt("the Arrow file footer is missing")
        else:
            handle.seek(max(0, file.size - 8))
            tail = handle.read(8)
            if not (tail == b"\xff\xff\xff\xff\x00\x00\x00\x00" or tail[-4:] == b"\x00" * 4):
                raise corrupt("the Arrow stream has no end-of-stream marker")
        handle.seek(8 if is_file_format else 0)
        try:
            reader = pa.ipc.MessageReader.open_stream(handle)
            schema = pa.ipc.read_schema(reader.read_next_message())
        except (pa.ArrowException, OSError, StopIteration) as e:
            raise corrupt("no Arrow schema at its start", e) from None
        self._check_schema(file, schema)
        self._schemas[index] = schema
        schema_range = (8 if is_file_format else 0, handle.tell())
        if is_file_format:
            try:
                listed, dictionary_ranges = self._index_from_footer(index, file, handle)
                if dictionary_ranges:
                    self._dictionaries[index] = [schema_range, *dictionary_ranges]
                return listed
            except DataError:
                raise
            except (ValueError, struct.error, IndexError) as e:
                raise corrupt("the Arrow file footer is unreadable", e) from None
        parts: list[_Part] = []
        dictionaries: list[tuple[int, int]] = []
        first = 0
        offset = handle.tell()
        while True:
            handle.seek(offset)
            try:
                header = _read_message_header(handle, offset, file.size)
            except (ValueError, struct.error, IndexError) as e:
                raise corrupt(
                    f"record batch {len(parts)} at byte {offset} is unreadable", e
                ) from None
            if header is None:  # end-of-stream marker
                break
            kind, rows, next_offset = header
            if kind == _DICTIONARY_BATCH:
                dictionaries.append((offset, next_offset))
            elif kind == _RECORD_BATCH:
                parts.append(_Part(index, offset, rows, first, next_offset))
                first += rows
            else:
                raise corrupt(f"unexpected Arrow message (type {kind}) at byte {offset}")
            offset = next_offset
        if dictionaries:
            self._dictionaries[index] = [schema_range, *dictionaries]
        return parts

    def _index_from_footer(
        self, index: int, file: _File, handle: Any
    ) -> tuple[list[_Part], list[tuple[int, int]]]:
        """The parts of an Arrow IPC *file*, and the byte ranges of its dictionary batches:
        its footer lists where every record batch is, so the metadata of all of them is read
        at once (concurrent ranged reads remotely)."""
        handle.seek(file.size - 10)
        (footer_size,) = struct.unpack("<i", handle.read(4))
        footer_start = file.size - 10 - footer_size
        if footer_size <= 0 or footer_start < 8:
            raise ValueError(f"footer length {footer_size}")
        handle.seek(footer_start)
        dictionaries, blocks = _footer_blocks(handle.read(footer_size))
        for offset, meta_len, body_len in dictionaries + blocks:
            if offset < 8 or meta_len < 8 or offset + meta_len + body_len > footer_start:
                raise ValueError(f"a record batch at byte {offset} runs past the data")
        if _is_local(file):
            metas = []
            for offset, meta_len, _ in blocks:
                handle.seek(offset)
                metas.append(handle.read(meta_len))
        else:
            metas = file.fs.cat_ranges(
                [file.path] * len(blocks),
                [b[0] for b in blocks],
                [b[0] + b[1] for b in blocks],
                on_error="raise",
            )
        parts: list[_Part] = []
        first = 0
        for (offset, meta_len, body_len), meta in zip(blocks, metas, strict=True):
            start = 8 if meta[:4] == _CONTINUATION else 4
            kind, body_length, rows = _parse_message(meta[start:])
            if kind != _RECORD_BATCH or body_length != body_len:
                raise ValueError(f"the message at byte {offset} is not the record batch listed")
            parts.append(_Part(index, offset, rows, first, offset + meta_len + body_len))
            first += rows
        return parts, [(o, o + m + b) for o, m, b in sorted(dictionaries)]

    def _read_with_dictionaries(
        self, part: _Part, dictionaries: list[tuple[int, int]]
    ) -> pa.RecordBatch:
        """The record batch of ``part`` from a file with dictionary batches (``dictionaries``:
        the byte ranges of its schema message, then of those)."""
        # Note: pyarrow decodes dictionary batches only inside a stream reader, so the record
        # batch is read as a stream of the schema, the dictionary batches in front of it (a
        # later one may replace or extend an earlier one) and the batch itself
        schema, *earlier = dictionaries
        ranges = [schema, *(r for r in earlier if r[0] < part.locator), (part.locator, part.end)]
        file = self._files[part.file]
        if _is_local(file):
            handle = self._open(part.file)
            pieces = []
            for start, end in ranges:
                handle.seek(start)
                pieces.append(handle.read(end - start))
        else:
            pieces = file.fs.cat_ranges(
                [file.path] * len(ranges),
                [r[0] for r in ranges],
                [r[1] for r in ranges],
                on_error="raise",
            )
        stream = b"".join(pieces) + _CONTINUATION + b"\0\0\0\0"  # end-of-stream marker
        return pa.ipc.open_stream(pa.py_buffer(stream)).read_next_batch()

    def _part(self, part_index: int) -> pa.Array:
        column = self._cache.get(part_index)
        if column is not None:
            self._cache.move_to_end(part_index)
            return column
        part = self._parts[part_index]
        file = self._files[part.file]
        if file.fmt == "parquet":
            table = self._open(part.file).read_row_group(part.locator, columns=[self.text_column])
            column = decoded(table.column(0)).combine_chunks()
        else:
            dictionaries = self._dictionaries.get(part.file)
            try:
                if dictionaries:
                    batch = self._read_with_dictionaries(part, dictionaries)
                else:
                    if _is_local(file):
                        handle = self._open(part.file)
                        handle.seek(part.locator)
                    else:  # one ranged request for exactly this message, not a read-ahead block
                        handle = pa.py_buffer(
                            file.fs.cat_file(file.path, start=part.locator, end=part.end)
                        )
                    message = pa.ipc.read_message(handle)
                    batch = pa.ipc.read_record_batch(message, self._schemas[part.file])
                # offsets inside the body are only trusted after a full check (UTF-8 too)
                batch.column(self.text_column).validate(full=True)
            except (pa.ArrowException, OSError) as e:
                raise DataError(
                    f"{file.url}: record batch at byte {part.locator} is unreadable ({e}); the "
                    "file is truncated or corrupt: write it again"
                ) from None
            column = decoded(batch.column(self.text_column))
        if column.null_count and self.nulls == "error":
            row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(
                f"{file.url}: row {part.first_row + row} has a null {self.text_column!r}; "
                "clean the data, or pass nulls='skip' to treat nulls as empty documents"
            )
        self._cache[part_index] = column
        if len(self._cache) > 4:  # a shuffle block spans a few parts; keep those
            self._cache.popitem(last=False)
        return column


def _resolve(
    entry: str,
    storage_options: dict[str, Any],
    *,
    dir_suffixes: tuple[str, ...] | None = None,
    dir_kind: str = "",
) -> list[_File]:
    """Expand one user entry (file, directory, `save_to_disk` directory, glob) to files.

    With ``dir_suffixes``, a directory stands for the files under it with those suffixes
    (``dir_kind`` names them in the error for none), not for Arrow and Parquet files.
    """
    fs, path = fsspec.core.url_to_fs(entry, **storage_options)
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    if any(c in path for c in "*?["):
        paths = data_files(entry, sorted(fs.glob(path)))
        if not paths:
            raise DataError(f"{entry}: the pattern matches no files")
    elif fs.isdir(path) and dir_suffixes is not None:
        check_not_dataset_dict(entry, fs, path)
        found = data_files(entry, sorted(fs.find(path)))
        paths = [p for p in found if p.lower().endswith(dir_suffixes)]
        if not paths:
            raise DataError(f"{entry}: the directory holds no {dir_kind} files")
    elif fs.isdir(path):
        check_not_dataset_dict(entry, fs, path)
        state = f"{path.rstrip('/')}/state.json"
        if fs.exists(state):  # written by datasets' save_to_disk, lists its shards in order
            with fs.open(state, "r") as f:
                names = [d["filename"] for d in json.load(f).get("_data_files", [])]
            paths = [f"{path.rstrip('/')}/{n}" for n in names]
        else:
            paths = [
                p
                for p in data_files(entry, sorted(fs.find(path)))
                if p.endswith(_ARROW_SUFFIXES + _PARQUET_SUFFIXES)
            ]
        if not paths:
            raise DataError(f"{entry}: the directory holds no .arrow or .parquet files")
    elif fs.exists(path):
        paths = [path]
    else:
        raise DataError(f"{entry}: no such file or directory")
    files = []
    for p in paths:
        if not fs.exists(p):
            raise DataError(f"{p}: no such file (listed in {entry})")
        fmt = "parquet" if p.endswith(_PARQUET_SUFFIXES) else "ipc"
        url = p if local else fs.unstrip_protocol(p)
        files.append(_File(url, p, fs, fmt, int(fs.size(p))))
    return files


def _is_local(file: _File) -> bool:
    protocols = file.fs.protocol if isinstance(file.fs.protocol, tuple) else (file.fs.protocol,)
    return "file" in protocols


def _open(file: _File, block_size: int | None = None) -> Any:
    if _is_local(file):
        return pa.memory_map(file.path, "r")
    kwargs = {} if block_size is None else {"block_size": block_size}
    return pa.PythonFile(file.fs.open(file.path, "rb", **kwargs), mode="r")


# --- Arrow IPC message headers, without their bodies -----------------------------------------
#
# Note: pyarrow reads a message's metadata and body together, and its file reader keeps the
# footer's block list to itself, so indexing a file through pyarrow reads every byte of it:
# over s3:// that is the whole object before the first batch. The encapsulated message
# format is small and stable (a continuation marker, the metadata length, a flatbuffer
# ``Message``, then the body), so the index reads the flatbuffer fields it needs here.


def _read_message_header(handle: Any, offset: int, file_size: int) -> tuple[int, int, int] | None:
    """``(header type, rows, offset of the next message)`` of the encapsulated IPC message
    at ``offset``, reading only its metadata; ``None`` at the end-of-stream marker."""
    prefix = handle.read(8)
    if len(prefix) < 4:
        raise ValueError("the stream ends without an end-of-stream marker")
    if prefix[:4] == _CONTINUATION:
        if len(prefix) < 8:
            raise ValueError("the stream ends inside a message prefix")
        (size,) = struct.unpack("<i", prefix[4:8])
        start = offset + 8
    else:  # the format before Arrow 0.15 has no continuation marker
        (size,) = struct.unpack("<i", prefix[:4])
        start = offset + 4
        handle.seek(start)
    if size == 0:
        return None
    if size < 0 or start + size > file_size:
        raise ValueError(f"metadata length {size} runs past the end of the file")
    kind, body_length, rows = _parse_message(handle.read(size))
    end = start + size + body_length
    if body_length < 0 or end > file_size:
        raise ValueError(f"a body of {body_length} bytes runs past the end of the file")
    return kind, rows, end


def _parse_message(meta: bytes) -> tuple[int, int, int]:
    """``(header type, body length, rows)`` from a flatbuffer ``org.apache.arrow.flatbuf.Message``
    (fields: version, header_type, header, bodyLength; ``RecordBatch`` field 0 is ``length``)."""
    message = _table(meta, struct.unpack_from("<I", meta, 0)[0])
    kind = _field(meta, message, 1, "<B", 0)
    body_length = _field(meta, message, 3, "<q", 0)
    rows = 0
    if kind == _RECORD_BATCH:
        pos = _field_pos(meta, message, 2)
        if pos is None:
            raise ValueError("a record batch message without its header")
        header = _table(meta, pos + struct.unpack_from("<I", meta, pos)[0])
        rows = _field(meta, header, 0, "<q", 0)
    return kind, body_length, rows


def _footer_blocks(
    footer: bytes,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """``(dictionary blocks, record batch blocks)`` of a flatbuffer ``Footer`` (fields:
    version, schema, dictionaries, recordBatches); a ``Block`` is the struct ``(offset: int64,
    metaDataLength: int32, padding, bodyLength: int64)``."""
    table = _table(footer, struct.unpack_from("<I", footer, 0)[0])

    def vector(slot: int) -> list[tuple[int, int, int]]:
        pos = _field_pos(footer, table, slot)
        if pos is None:
            return []
        start = pos + struct.unpack_from("<I", footer, pos)[0]
        (count,) = struct.unpack_from("<I", footer, start)
        if start + 4 + 24 * count > len(footer):
            raise ValueError("the footer's block list runs past its end")
        return [
            (o, m, b)
            for o, m, _, b in (
                struct.unpack_from("<qiiq", footer, start + 4 + 24 * i) for i in range(count)
            )
        ]

    return vector(2), vector(3)


def _table(buf: bytes, pos: int) -> tuple[int, int]:
    """A flatbuffer table at ``pos``: ``(table position, vtable position)``."""
    (back,) = struct.unpack_from("<i", buf, pos)
    vtable = pos - back
    if not 0 <= vtable < len(buf) or not 0 <= pos < len(buf):
        raise ValueError("a flatbuffer offset points outside the metadata")
    return pos, vtable


def _field_pos(buf: bytes, table: tuple[int, int], slot: int) -> int | None:
    pos, vtable = table
    (vtable_size,) = struct.unpack_from("<H", buf, vtable)
    if 4 + 2 * slot >= vtable_size:
        return None
    (rel,) = struct.unpack_from("<H", buf, vtable + 4 + 2 * slot)
    return pos + rel if rel else None


def _field(buf: bytes, table: tuple[int, int], slot: int, fmt: str, default: int) -> int:
    pos = _field_pos(buf, table, slot)
    return default if pos is None else int(struct.unpack_from(fmt, buf, pos)[0])
