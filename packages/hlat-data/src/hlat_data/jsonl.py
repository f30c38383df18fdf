"""Documents streamed directly from JSON lines files: plain, gzip and zstd.

Opening a :class:`JsonlSource` reads each file once and indexes where every non-blank line
starts (NumPy over the bytes, a block at a time: memory-mapped for local files, ranged
reads through fsspec for ``s3://`` and other URLs). Document ``i`` is then one ranged read
of its line, with no copy of the file on local disk and nothing held per document but its
offset.

A compressed file is random access per gzip member or zstd frame: the index also holds the
compressed byte range of each member and where its bytes fall in the decompressed stream,
and reading a document decompresses only the members its line lies in (the last few stay
cached). Lines may run across members, as ``bgzip`` and ``pzstd`` cut them. A file written
as one member is read whole for any document, so a member over ``max_member_bytes`` is
refused at open.
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import fsspec
import numpy as np

from hlat_data.errors import DataError
from hlat_data.source import (
    _ARROW_SUFFIXES,
    _PARQUET_SUFFIXES,
    ArrowSource,
    FileSource,
    _File,
    _is_local,
    _OpenFiles,
    _resolve,
    bad_record_policy,
    check_not_dataset_dict,
    data_files,
)

_LINE_SUFFIXES = (".jsonl", ".ndjson", ".json")
JSONL_SUFFIXES = tuple(s + c for s in _LINE_SUFFIXES for c in ("", ".gz", ".zst"))
"""File names read as JSON lines: ``.jsonl``, ``.ndjson``, ``.json``, each optionally
``.gz`` or ``.zst``."""
_KIND = "JSON lines (.jsonl, .ndjson, .json, optionally .gz or .zst)"

_INDEX_BLOCK = 8 << 20  # bytes scanned for newlines per step while indexing
_FEED = 64 << 10  # compressed bytes decompressed per step while indexing
_MERGE_GAP = 256 << 10  # neighbouring ranges closer than this are fetched in one read
_CACHE_BYTES = 256 << 20  # decompressed members kept beyond the last two
_WHITESPACE = b" \t\r"  # with the newline, what a blank line holds (JSON's whitespace)
_BOM = b"\xef\xbb\xbf"
_GZIP_FIX = "recompress it in members of a few MB (`bgzip`, or gzip parts and concatenate them)"
_ZSTD_FIX = "recompress it in frames of a few MB (`pzstd`, or zstd parts and concatenate them)"


def is_jsonl(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a JSON lines file (by its suffix, see ``JSONL_SUFFIXES``)."""
    return os.fspath(path).lower().endswith(JSONL_SUFFIXES)


class JsonlSource(FileSource):
    """Documents from JSON lines files, one JSON object per line, with random access.

    The same interface as :class:`~hlat_data.ArrowSource`: ``len()``, ``files``,
    ``fingerprint()``, ``text(i)``, ``texts(ids)``, ``documents(ids)``.

    Args:
        paths_or_urls: a path or URL, or a list of them: files, globs, or directories
            (read for ``.jsonl``, ``.ndjson`` and ``.json`` files, each optionally ``.gz``
            or ``.zst``). Local files are memory-mapped; other fsspec URLs (``s3://...``)
            are read by ranged requests. A file is gzip when its name ends in ``.gz``,
            zstd when in ``.zst`` (which needs ``pip install hlat-data[zstd]``).
        text_field: the field of each object holding the document.
        max_chars: documents longer than this are split into pieces (:func:`~hlat_data.source.split_text`:
            before a space that follows a non-space where the window has one), still one
            document for packing, with the ids of the whole text: the tokenizer encodes the
            pieces apart only where that is proven exact (SentencePiece BPE with an identity
            normalizer, Llama's kind) and joins them back elsewhere
            (:meth:`~hlat_data.Tokenizer.encode_documents`).
        on_bad_record: a line that is not UTF-8, not JSON, not an object, or whose field is
            missing or not a string (null included) raises :class:`DataError` naming the
            file and line (``"error"``, the default), or is read as an empty document
            (``"skip"``), which the loader skips and counts in ``loader.bad_records``.
        storage_options: passed to fsspec for URLs (credentials, ``client_kwargs``).
        max_member_bytes: the largest decompressed gzip member or zstd frame accepted;
            reading any document of a member decompresses all of it.

    Note:
        Blank lines (nothing but spaces, tabs and carriage returns) are not documents: the
        documents of a file are its other lines, in order. Errors give the line number in
        the file, blank lines counted. A UTF-8 byte order mark at the start is ignored.
    """

    def __init__(
        self,
        paths_or_urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        text_field: str = "text",
        max_chars: int = 500_000,
        on_bad_record: str = "error",
        storage_options: dict[str, Any] | None = None,
        *,
        max_member_bytes: int = 256 << 20,
    ) -> None:
        if max_chars < 1:
            raise DataError(f"max_chars must be at least 1, got {max_chars}")
        if max_member_bytes < 1:
            raise DataError(f"max_member_bytes must be at least 1, got {max_member_bytes}")
        self.text_field = text_field
        self.max_chars = max_chars
        self.on_bad_record = bad_record_policy(on_bad_record)
        self.max_member_bytes = max_member_bytes
        entries = [paths_or_urls] if isinstance(paths_or_urls, str | os.PathLike) else paths_or_urls
        self._files: list[_File] = []
        for entry in entries:
            found = _resolve(
                os.fspath(entry), storage_options or {}, dir_suffixes=JSONL_SUFFIXES, dir_kind=_KIND
            )
            self._files += [replace(f, fmt=compression(f.path)) for f in found]
        if not self._files:
            raise DataError(f"no data files given: {paths_or_urls!r}")
        for file in self._files:
            if file.fmt == "zstd":
                _zstandard(file.url)
        self._handles = _OpenFiles()  # memory maps of local files
        self._starts: list[np.ndarray] = []  # per file: where each document's line starts
        self._sizes: list[int] = []  # per file: bytes of its (decompressed) text
        self._blanks: list[np.ndarray] = []  # per file: documents before each blank line
        self._members: list[np.ndarray | None] = []  # per file: (compressed start, end, text start)
        for index, file in enumerate(self._files):
            self._index(index, file)
        counts = np.array([len(s) for s in self._starts], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(counts)])
        if self._offsets[-1] == 0:
            raise DataError(
                f"the corpus is empty: {len(self._files)} file(s) with no lines "
                f"({', '.join(f.url for f in self._files[:3])})"
            )
        self._cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()

    # --- public ---------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this corpus: file base names, sizes and line counts, field,
        split limit. The bad-record policy is not part of it: it changes no document that
        ``"error"`` reads, so a run stopped by a bad record resumes with ``"skip"``."""
        counts = [len(s) for s in self._starts]
        return self._fingerprint(
            ["jsonl", self._base_names(), counts, self.text_field, self.max_chars],
            text_field=self.text_field,
            max_chars=self.max_chars,
        )

    def texts_with_bad(self, indices: Iterable[int]) -> tuple[list[str], np.ndarray]:
        """The documents at ``indices``, and the positions in ``indices`` of bad records,
        read as ``""`` (none unless ``on_bad_record="skip"``: else the first one raises)."""
        ids = np.asarray(list(indices) if not isinstance(indices, np.ndarray) else indices)
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"document index out of range 0..{len(self) - 1}")
        files = np.searchsorted(self._offsets, ids, side="right") - 1
        local = ids - self._offsets[files]
        starts = np.empty(len(ids), dtype=np.int64)
        ends = np.empty(len(ids), dtype=np.int64)
        for f in np.unique(files).tolist():
            mask = files == f
            lines = self._starts[f]
            here = local[mask]
            after = here + 1
            starts[mask] = lines[here]
            ends[mask] = np.where(
                after < len(lines), lines[np.minimum(after, len(lines) - 1)], self._sizes[f]
            )
        raws = self._read(files, starts, ends)
        out: list[str] = []
        bad: list[int] = []
        for position, raw in enumerate(raws):
            text, problem = _parse(raw, self.text_field)
            if problem is not None:
                if self.on_bad_record == "error":
                    f = int(files[position])
                    line = self._line_number(f, int(local[position]))
                    raise DataError(
                        f"{self._files[f].url} line {line}: {problem}; fix the record, or pass "
                        "on_bad_record='skip' (hlat-data stats: --on-bad-record skip) to read "
                        "bad records as empty documents"
                    )
                bad.append(position)
            out.append(text)
        return out, np.array(bad, dtype=np.int64)

    def __repr__(self) -> str:
        return (
            f"JsonlSource({len(self)} documents in {len(self._files)} file(s), "
            f"field {self.text_field!r})"
        )

    # --- indexing -------------------------------------------------------------------------

    def _index(self, index: int, file: _File) -> None:
        lines = _LineIndex()
        members = None
        if file.fmt == "plain":
            for block in self._blocks(index, file):
                lines.feed(block)
        else:
            members = _scan_members(file, self._blocks(index, file), lines, self.max_member_bytes)
        self._handles.close(index)  # mapped again when read
        starts, blanks, size = lines.finish()
        self._starts.append(starts)
        self._blanks.append(blanks)
        self._sizes.append(size)
        self._members.append(members)

    def _blocks(self, index: int, file: _File) -> Iterator[np.ndarray]:
        """The bytes of ``file`` (as stored) in blocks of ``_INDEX_BLOCK``."""
        if file.size == 0:
            return
        if _is_local(file):
            data = self._map(index)
            for start in range(0, len(data), _INDEX_BLOCK):
                yield data[start : start + _INDEX_BLOCK]
            return
        try:
            handle = file.fs.open(file.path, "rb", block_size=_INDEX_BLOCK, cache_type="none")
        except TypeError:  # a filesystem without fsspec's buffered-file options
            handle = file.fs.open(file.path, "rb")
        with handle:
            while block := handle.read(_INDEX_BLOCK):
                yield np.frombuffer(block, dtype=np.uint8)

    def _line_number(self, file: int, document: int) -> int:
        """The 1-based line number of the file's ``document``-th document."""
        return document + 1 + int(np.searchsorted(self._blanks[file], document, side="right"))

    # --- reading --------------------------------------------------------------------------

    def _map(self, index: int) -> np.ndarray:
        """The bytes of local file ``index``, memory-mapped; callers copy out what they keep."""
        mapped = self._handles.get(index)
        if mapped is None:
            file = self._files[index]
            try:
                with open(file.path, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError:
                raise DataError(f"{file.url}: no such file") from None
            self._handles.add(index, mapped)
        return np.frombuffer(mapped, dtype=np.uint8)

    def _fetch(self, requests: list[tuple[int, int, int]]) -> list[bytes]:
        """The stored bytes ``[start, end)`` of each ``(file, start, end)``; the remote ones in
        one concurrent ``cat_ranges`` call."""
        out: list[bytes] = [b""] * len(requests)
        remote: dict[Any, list[int]] = {}
        for k, (f, start, end) in enumerate(requests):
            file = self._files[f]
            if _is_local(file):
                out[k] = self._map(f)[start:end].tobytes()
            else:
                remote.setdefault(id(file.fs), []).append(k)
        for ks in remote.values():
            fs = self._files[requests[ks[0]][0]].fs
            got = fs.cat_ranges(
                [self._files[requests[k][0]].path for k in ks],
                [requests[k][1] for k in ks],
                [requests[k][2] for k in ks],
                on_error="raise",
            )
            for k, data in zip(ks, got, strict=True):
                if len(data) != requests[k][2] - requests[k][1]:
                    file = self._files[requests[k][0]]
                    raise DataError(
                        f"{file.url}: read {len(data)} bytes at byte {requests[k][1]}, expected "
                        f"{requests[k][2] - requests[k][1]}; the file changed since it was opened"
                    )
                out[k] = data
        return out

    def _read(self, files: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> list[bytes]:
        """The text bytes ``[starts[k], ends[k])`` of file ``files[k]``, for every ``k``."""
        out: list[bytes] = [b""] * len(files)
        plain: list[int] = []
        packed: list[int] = []
        for k, f in enumerate(files.tolist()):
            (plain if self._members[f] is None else packed).append(k)
        if plain:
            self._read_plain(plain, files, starts, ends, out)
        if packed:
            self._read_packed(packed, files, starts, ends, out)
        return out

    def _read_plain(
        self,
        ks: list[int],
        files: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        out: list[bytes],
    ) -> None:
        order = sorted(ks, key=lambda k: (int(files[k]), int(starts[k])))
        runs: list[tuple[int, int, int]] = []  # file, start, end
        members: list[list[int]] = []
        for k in order:
            f, s, e = int(files[k]), int(starts[k]), int(ends[k])
            if (
                runs
                and runs[-1][0] == f
                and s - runs[-1][2] <= _MERGE_GAP
                and not _is_local(self._files[f])
            ):
                runs[-1] = (f, runs[-1][1], max(runs[-1][2], e))
                members[-1].append(k)
            else:
                runs.append((f, s, e))
                members.append([k])
        for (_, begin, _), ks_run, data in zip(runs, members, self._fetch(runs), strict=True):
            for k in ks_run:
                out[k] = data[int(starts[k]) - begin : int(ends[k]) - begin]

    def _read_packed(
        self,
        ks: list[int],
        files: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        out: list[bytes],
    ) -> None:
        spans: dict[int, tuple[int, int]] = {}  # k -> first and last member of its bytes
        needed: set[tuple[int, int]] = set()
        for k in ks:
            f = int(files[k])
            text_starts = self._member_table(f)[:, 2]
            first = int(np.searchsorted(text_starts, starts[k], side="right")) - 1
            last = int(np.searchsorted(text_starts, ends[k] - 1, side="right")) - 1
            spans[k] = (first, last)
            needed.update((f, m) for m in range(first, last + 1))
        have = {key: self._cache[key] for key in needed if key in self._cache}
        have.update(self._decompress(sorted(needed - have.keys())))
        for k in ks:
            f = int(files[k])
            first, last = spans[k]
            table = self._member_table(f)
            pieces = []
            for m in range(first, last + 1):
                begin = int(table[m, 2])
                data = have[(f, m)]
                pieces.append(data[max(0, int(starts[k]) - begin) : int(ends[k]) - begin])
            out[k] = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        for key in sorted(needed):  # most recent last
            self._cache[key] = have[key]
            self._cache.move_to_end(key)
        held = sum(len(v) for v in self._cache.values())
        while len(self._cache) > 2 and held > _CACHE_BYTES:
            held -= len(self._cache.popitem(last=False)[1])

    def _member_table(self, f: int) -> np.ndarray:
        table = self._members[f]
        assert table is not None
        return table

    def _decompress(self, keys: list[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
        """Members ``(file, member)`` fetched (neighbours in one read) and decompressed."""
        runs: list[tuple[int, int, int]] = []
        grouped: list[list[int]] = []
        for f, m in keys:
            table = self._member_table(f)
            start, end = int(table[m, 0]), int(table[m, 1])
            if runs and runs[-1][0] == f and start - runs[-1][2] <= _MERGE_GAP:
                runs[-1] = (f, runs[-1][1], end)
                grouped[-1].append(m)
            else:
                runs.append((f, start, end))
                grouped.append([m])
        out: dict[tuple[int, int], bytes] = {}
        for (f, begin, _), ms, data in zip(runs, grouped, self._fetch(runs), strict=True):
            file = self._files[f]
            table = self._member_table(f)
            for m in ms:
                start, end, text_start = (int(v) for v in table[m])
                text_end = int(table[m + 1, 2]) if m + 1 < len(table) else self._sizes[f]
                decoder = _decompressor(file)
                try:
                    text = decoder.decompress(data[start - begin : end - begin])
                except Exception as e:
                    text, detail = b"", f" ({e})"
                else:
                    detail = ""
                if len(text) != text_end - text_start or not decoder.eof:
                    raise DataError(
                        f"{file.url}: the {_UNIT[file.fmt]} at byte {start} no longer decompresses "
                        f"to the {text_end - text_start} bytes indexed{detail}; the file changed "
                        "since it was opened, or is damaged"
                    )
                out[(f, m)] = text
        return out


# --- indexing helpers ------------------------------------------------------------------------

_UNIT = {"gzip": "gzip member", "zstd": "zstd frame"}


class _LineIndex:
    """Where each non-blank line of a byte stream starts, from the stream fed in blocks.

    A line ends at ``\\n``; a blank line holds nothing but ``_WHITESPACE``. A document's
    bytes run from its line start to the next document's (or the stream's end), so they
    carry its newline and any blank lines after it: JSON whitespace, which the parser
    ignores, and the index holds one offset per document.
    """

    def __init__(self) -> None:
        self.pos = 0  # stream offset of the next byte fed
        self.open_start = 0  # start of the line not yet ended
        self.open_nonblank = False  # whether it holds anything but whitespace so far
        self.starts: list[np.ndarray] = []
        self.blanks: list[np.ndarray] = []
        self.count = 0  # non-blank lines ended so far

    def feed(self, data: bytes | np.ndarray) -> None:
        block = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        n = len(block)
        if n == 0:
            return
        first = 0
        if self.pos == 0 and n >= 3 and block[:3].tobytes() == _BOM:
            first = self.open_start = 3
        newlines = np.flatnonzero(block == 10)
        piece_starts = np.empty(len(newlines) + 1, dtype=np.int64)
        piece_starts[0] = first
        piece_starts[1:] = newlines + 1
        piece_ends = np.empty_like(piece_starts)
        piece_ends[:-1] = newlines
        piece_ends[-1] = n
        nonblank = _nonblank(block, piece_starts, piece_ends)
        if not len(newlines):
            self.open_nonblank |= bool(nonblank[0])
            self.pos += n
            return
        ended = nonblank[:-1].copy()
        ended[0] |= self.open_nonblank
        starts = self.pos + piece_starts[:-1]
        starts[0] = self.open_start
        self.starts.append(starts[ended])
        if not ended.all():
            before = self.count + np.cumsum(ended) - ended
            self.blanks.append(before[~ended])
        self.count += int(ended.sum())
        self.open_start = self.pos + int(piece_starts[-1])
        self.open_nonblank = bool(nonblank[-1])
        self.pos += n

    def finish(self) -> tuple[np.ndarray, np.ndarray, int]:
        """``(line starts, documents before each blank line, stream length)``."""
        if self.open_nonblank:  # a last line without a newline
            self.starts.append(np.array([self.open_start], dtype=np.int64))
        starts = np.concatenate(self.starts) if self.starts else np.zeros(0, dtype=np.int64)
        dtype = np.uint32 if self.pos < 2**32 else np.int64  # half the index for most files
        blanks = np.concatenate(self.blanks) if self.blanks else np.zeros(0, dtype=np.int64)
        return starts.astype(dtype), blanks.astype(np.int64), self.pos


def _nonblank(block: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Whether each piece ``block[starts[k]:ends[k]]`` holds a byte other than whitespace.

    Note: a line of JSON starts with ``{`` (or another non-blank byte), so only pieces
    that start with whitespace are looked at further.
    """
    nonempty = ends > starts
    head = block[np.minimum(starts, len(block) - 1)]
    out = nonempty & (head != 32) & (head != 9) & (head != 13)
    for k in np.flatnonzero(nonempty & ~out).tolist():
        out[k] = bool(block[starts[k] : ends[k]].tobytes().strip(_WHITESPACE))
    return out


def _scan_members(
    file: _File, blocks: Iterator[np.ndarray], lines: _LineIndex, limit: int
) -> np.ndarray:
    """Decompresses every gzip member / zstd frame of ``file`` once, feeding ``lines``;
    returns one row ``(compressed start, compressed end, text start)`` per member that
    holds bytes (the empty ones, such as bgzip's end marker and zstd's skippable frames,
    are left out)."""
    members: list[tuple[int, int, int]] = []
    member_size = text_pos = 0
    for member_start, text, end in decompressed(file, blocks):
        if text:
            member_size += len(text)
            if member_size > limit:
                fix = _GZIP_FIX if file.fmt == "gzip" else _ZSTD_FIX
                raise DataError(
                    f"{file.url}: the {_UNIT[file.fmt]} at byte {member_start} decompresses to "
                    f"more than max_member_bytes={limit}; reading any line of it would "
                    f"decompress all of it, so {fix}, pass a larger max_member_bytes=, or "
                    "convert the file to Arrow with `hlat-data convert`"
                )
            lines.feed(text)
        if end is not None:
            if member_size:
                members.append((member_start, end, text_pos))
                text_pos += member_size
            member_size = 0
    return np.array(members, dtype=np.int64).reshape(-1, 3)


def decompressed(
    file: _File, blocks: Iterator[np.ndarray]
) -> Iterator[tuple[int, bytes, int | None]]:
    """The text of a gzip or zstd ``file``, member by member (frame by frame), from its stored
    bytes fed in ``blocks``: ``(start, text, end)`` steps, where ``start`` is the byte offset
    of the member ``text`` comes from, and ``end`` is None but in the member's last step,
    where it is the offset just past the member. Zero padding after a gzip member is skipped.

    Raises:
        DataError: naming the file and the member for damaged or truncated data.
    """
    unit = _UNIT[file.fmt]
    buffer = b""
    at = 0  # position in buffer
    offset = 0  # file offset of buffer[at]
    decoder: Any = None
    member_start = 0
    while True:
        if at >= len(buffer):
            block = next(blocks, None)
            if block is None:
                break
            buffer, at = block.tobytes(), 0
        if decoder is None:
            if file.fmt == "gzip" and buffer[at] == 0:  # padding after a member, as gzip allows
                rest = len(buffer) - at
                at = len(buffer) - len(buffer[at:].lstrip(b"\0"))
                offset += rest - (len(buffer) - at)
                if at >= len(buffer):
                    continue
            decoder = _decompressor(file)
            member_start = offset
        piece = buffer[at : at + _FEED]
        try:
            text = decoder.decompress(piece)
        except Exception as e:
            raise DataError(
                f"{file.url}: the {unit} at byte {member_start} cannot be decompressed ({e}); "
                f"the file is damaged or not {file.fmt} data"
            ) from None
        used = len(piece) - len(decoder.unused_data) if decoder.eof else len(piece)
        at += used
        offset += used
        ended = bool(decoder.eof)
        yield member_start, text, offset if ended else None
        if ended:
            decoder = None
    if decoder is not None:
        raise DataError(
            f"{file.url}: the file ends inside the {unit} at byte {member_start}; it is "
            "truncated: write it again"
        )


def compression(path: str) -> str:
    """``"gzip"``, ``"zstd"`` or ``"plain"``: how a JSON lines file is stored, by its suffix."""
    name = path.lower()
    if name.endswith((".gz", ".gzip")):
        return "gzip"
    if name.endswith((".zst", ".zstd")):
        return "zstd"
    return "plain"


def _zstandard(url: str) -> Any:
    try:
        import zstandard
    except ImportError:
        raise DataError(
            f"{url}: reading .zst files needs the zstandard package: pip install hlat-data[zstd]"
        ) from None
    return zstandard


def _decompressor(file: _File) -> Any:
    """A decompressor of one gzip member or zstd frame (``decompress``, ``eof``,
    ``unused_data``)."""
    if file.fmt == "gzip":
        return zlib.decompressobj(wbits=31)
    return _zstandard(file.url).ZstdDecompressor().decompressobj()


# --- records ---------------------------------------------------------------------------------


def _parse(raw: bytes, field: str) -> tuple[str, str | None]:
    """``(text, None)`` for a good record, ``("", what is wrong)`` for a bad one."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return "", f"not valid UTF-8 ({e.reason} at byte {e.start + 1} of the line)"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        where = f"column {e.colno}" if e.lineno == 1 else "the end of the line"
        return "", f"not valid JSON ({e.msg} at {where})"
    except (ValueError, RecursionError) as e:  # integers of over 4300 digits; deep nesting
        return "", f"not valid JSON ({type(e).__name__}: {e})"
    if not isinstance(record, dict):
        return "", f"not a JSON object but {_kind(record)}"
    if field not in record:
        keys = list(record)
        shown = ", ".join(keys[:10]) + (", ..." if len(keys) > 10 else "")
        return "", f"field {json.dumps(field)} is missing (keys: {shown or 'none'})"
    value = record[field]
    if not isinstance(value, str):
        what = "null" if value is None else f"{_kind(value)}, not a string"
        return "", f"field {json.dumps(field)} is {what}"
    if "\\u" in line and not _encodable(value):
        return "", f"field {json.dumps(field)} holds an unpaired surrogate escape, not Unicode text"
    return value, None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


# --- choosing the source ---------------------------------------------------------------------


def open_source(
    paths_or_urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    text_field: str = "text",
    *,
    on_bad_record: str = "error",
    max_chars: int = 500_000,
    storage_options: dict[str, Any] | None = None,
) -> ArrowSource | JsonlSource:
    """The source for ``paths_or_urls``: a :class:`JsonlSource` when every input is JSON
    lines (by suffix, see ``JSONL_SUFFIXES``; a directory by the files under it), an
    :class:`~hlat_data.ArrowSource` when none is.

    Raises:
        DataError: for a mix of JSON lines and other inputs.
    """
    entries = [paths_or_urls] if isinstance(paths_or_urls, str | os.PathLike) else paths_or_urls
    options = storage_options or {}
    seen: dict[str, str] = {}
    for entry in entries:
        for kind, example in _kinds(os.fspath(entry), options):
            seen.setdefault(kind, example)
    if len(seen) > 1:
        raise DataError(
            f"a mix of JSON lines ({seen['jsonl']}) and Arrow/Parquet ({seen['table']}) inputs; "
            "open them as two sources, or convert the JSON lines to Arrow (hlat-data convert)"
        )
    bad_record_policy(on_bad_record)
    if "jsonl" in seen:
        return JsonlSource(
            paths_or_urls, text_field, max_chars, on_bad_record, storage_options=storage_options
        )
    return ArrowSource(
        paths_or_urls,
        text_field,
        max_chars,
        storage_options=storage_options,
        on_bad_record=on_bad_record,
    )


def _kinds(entry: str, options: dict[str, Any]) -> list[tuple[str, str]]:
    """``("jsonl" | "table", an example path)`` for what ``entry`` holds."""
    if is_jsonl(entry):
        return [("jsonl", entry)]
    if entry.lower().endswith(_ARROW_SUFFIXES + _PARQUET_SUFFIXES):
        return [("table", entry)]
    fs, path = fsspec.core.url_to_fs(entry, **options)
    if any(c in path for c in "*?["):
        names = data_files(entry, sorted(fs.glob(path)))
    elif fs.isdir(path) and not fs.exists(f"{path.rstrip('/')}/state.json"):
        check_not_dataset_dict(entry, fs, path)
        names = [
            p
            for p in data_files(entry, sorted(fs.find(path)))
            if is_jsonl(p) or p.lower().endswith(_ARROW_SUFFIXES + _PARQUET_SUFFIXES)
        ]
    else:
        return [("table", entry)]  # a save_to_disk directory, or for ArrowSource to judge
    kinds: dict[str, str] = {}
    for name in names:
        kinds.setdefault("jsonl" if is_jsonl(name) else "table", name)
    return list(kinds.items()) or [("table", entry)]
