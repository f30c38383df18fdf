"""Checksums computed while DCP writes a checkpoint to a local file system.

DCP's ``FileSystemWriter`` opens every file it writes (the shards ``__<rank>_<n>.distcp`` and
``.metadata``) through its file-system object's ``create_stream(path, mode)``.
:class:`ChecksumWriter` is that writer with a file system whose streams pass every byte on
to the real file and fold it into a CRC-32 on the way, so the manifest gets each file's
checksum without reading the checkpoint back. DCP itself is unchanged: same planner, same
files, same ``thread_count`` and fsyncs.

A checksum is kept only when it provably covers the whole file: the stream was opened with
``"wb"`` (from offset 0), saw only in-order writes (a ``seek`` elsewhere or a ``truncate``
drops it), and its byte count equals the file's size at the commit. Anything else is read
back by the commit as before (:func:`hlat_ckpt.manifest.checksum_files`).

This module imports ``torch.distributed.checkpoint``; :mod:`hlat_ckpt.checkpointer` imports
it with the first save.
"""

from __future__ import annotations

import functools
import io
import os
import threading
import zlib
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from .manifest import CHECKSUM_ALGORITHM

OVERLAP_BYTES = 1 << 20
"""Writes at least this large are checksummed in a helper thread while the calling thread
writes the same buffer (``zlib.crc32`` and file writes both release the GIL), so the
checksum costs no time beside the write; smaller ones are checksummed inline."""


class _Users:
    """How many open blocks of :func:`zip_crc_skipped` share one scope of torch's switch,
    and the switch's value before the first of them."""

    def __init__(self) -> None:
        self.count = 0
        self.before = True


_users_lock = threading.Lock()
_process_users = _Users()
_thread_users = threading.local()


@functools.cache
def _switch_is_per_thread() -> bool:
    """Whether ``set_crc32_options`` sets the option for the calling thread only (torch
    keeps user overrides of its config modules in a ``ContextVar`` in newer versions,
    e.g. 2.13) or for the process (e.g. 2.9)."""
    try:
        from torch.utils.serialization import config

        entry = config._config["save.compute_crc32"]  # type: ignore[attr-defined]
    except (ImportError, AttributeError, KeyError):
        return False
    return isinstance(getattr(entry, "user_override", None), ContextVar)


def _scope() -> _Users:
    if not _switch_is_per_thread():
        return _process_users
    users = getattr(_thread_users, "users", None)
    if users is None:
        users = _thread_users.users = _Users()
    return cast(_Users, users)


@contextmanager
def zip_crc_skipped() -> Generator[None, None, None]:
    """Within this block ``torch.save`` writes its zip records without their CRC-32
    (``torch.serialization.set_crc32_options(False)``); the option as it was is restored
    when the last open block of its scope ends.

    DCP writes each tensor with ``torch.save`` into the checkpoint file, and ``torch.save``
    computes a CRC-32 of every record for its zip header by default: a second pass over
    every byte, beside the CRC-32 of the whole file that the manifest keeps (computed while
    writing, or read back at the commit). Nothing reads the records' one: ``torch.load``
    and DCP's loads do not check it, and the manifest's covers the same bytes.

    Note: where torch keeps the switch per thread (2.13), each of DCP's writing threads
    enters this block when it opens a file (:class:`ChecksumFileSystem`), and nothing else
    in the process is affected. Where the switch is the process's (2.9), a ``torch.save``
    in another thread while a checkpoint is written (the training thread during an async
    save) also writes zero CRCs into its zip headers: ``torch.load`` reads such files as
    usual, but a zip tool's integrity test flags them.
    """
    scope = _scope()
    with _users_lock:
        if scope.count == 0:
            scope.before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        scope.count += 1
    try:
        yield
    finally:
        with _users_lock:
            scope.count -= 1
            if scope.count == 0:
                torch.serialization.set_crc32_options(scope.before)


def format_crc(crc: int) -> str:
    """A CRC-32 as the manifest records it: ``"crc32:<8 hex digits>"``."""
    return f"{CHECKSUM_ALGORITHM}:{crc:08x}"


class ChecksumStream(io.IOBase):
    """A write-only stream over ``raw`` that keeps the CRC-32 and count of the bytes written.

    ``on_close(stream)`` is called once, after ``raw`` closed without error; :attr:`exact`
    says whether :attr:`crc` covers exactly the file's bytes in order.
    """

    def __init__(self, raw: Any, on_close: Callable[[ChecksumStream], None]):
        super().__init__()
        self._raw = raw
        self._on_close = on_close
        self._helper: ThreadPoolExecutor | None = None
        self.crc = 0
        self.nbytes = 0
        self.exact = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self._raw.seekable())

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if not self.exact:
            return int(self._raw.write(view))
        pending: Future[int] | None = None
        if len(view) >= OVERLAP_BYTES:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="hlat-ckpt-crc")
            try:
                pending = self._helper.submit(zlib.crc32, view, self.crc)
            except RuntimeError:  # at interpreter exit executors take no new work: inline
                pending = None
        try:
            written = self._raw.write(view)
        except BaseException:
            self.exact = False
            raise
        finally:
            crc = pending.result() if pending is not None else None
        if written != len(view):  # a short write (non-blocking raw stream): the caller retries
            self.exact = False
            return int(written or 0)
        self.crc = crc if crc is not None else zlib.crc32(view, self.crc)
        self.nbytes += len(view)
        return len(view)

    def tell(self) -> int:
        return int(self._raw.tell())

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        position = int(self._raw.seek(offset, whence))
        if position != self.nbytes:  # later writes would land out of order
            self.exact = False
        return position

    def truncate(self, size: int | None = None) -> int:
        self.exact = False
        return int(self._raw.truncate(size))

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def fileno(self) -> int:
        # Note: DCP fsyncs ``fileno()`` of the stream it wrote `.metadata` into without
        # flushing it first, so the bytes still in Python's buffer would miss that fsync;
        # flushing here makes every fsync of this stream cover all the bytes written to it.
        self.flush()
        return int(self._raw.fileno())

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._raw.closed or self._raw.tell() != self.nbytes:
                self.exact = False  # closed behind our back, or not all bytes came through here
            self._raw.close()
            self._on_close(self)
        finally:
            if self._helper is not None:
                self._helper.shutdown(wait=True)
                self._helper = None
            super().close()


class ChecksumFileSystem(FileSystem):
    """DCP's local ``FileSystem`` whose ``"wb"`` streams are :class:`ChecksumStream`; it
    remembers the CRC-32 and size of every file written through it, by path, and follows
    DCP's renames (``.metadata.tmp`` to ``.metadata``) and deletions."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._sums: dict[str, tuple[int, int]] = {}  # path: (crc, bytes)
        self.errors: list[str] = []
        """Every error raised while a file was opened, written or synced, ``"path: error"``.

        Note: DCP's extra writing threads (``thread_count > 1``, torch 2.13) die on an
        error without passing it on: ``dcp.save`` returns and writes metadata without
        the lost items. The caller checks this list after ``dcp.save`` instead."""

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if mode == "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        key = os.fspath(path)
        self._forget(key)  # a file written again, or updated in place, is read back
        try:
            with super().create_stream(path, mode) as raw:
                if mode != "wb":
                    yield raw
                    return
                stream = ChecksumStream(raw, lambda s: self._record(key, s))
                try:
                    with zip_crc_skipped():  # the file's CRC-32 is computed here
                        yield stream
                except BaseException:
                    stream.exact = False  # the writer gave up on this file
                    raise
                finally:
                    stream.close()
        except BaseException as e:
            with self._lock:
                self.errors.append(f"{key}: {type(e).__name__}: {e}")
            raise

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self._sums.pop(os.fspath(path), None)
            self._sums.pop(os.fspath(new_path), None)
            if entry is not None:
                self._sums[os.fspath(new_path)] = entry

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self._forget(os.fspath(path))
        super().rm_file(path)

    def _record(self, key: str, stream: ChecksumStream) -> None:
        if stream.exact:
            with self._lock:
                self._sums[key] = (stream.crc, stream.nbytes)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._sums.pop(key, None)

    def checksums(self, root: str | os.PathLike[str]) -> dict[str, tuple[str, int]]:
        """``{path relative to root: (checksum, bytes)}`` of the files written under
        ``root``, with ``/`` as separator (as :meth:`hlat_ckpt.storage.Storage.file_sizes`
        names them)."""
        base = Path(root).absolute()
        with self._lock:
            sums = dict(self._sums)
        found: dict[str, tuple[str, int]] = {}
        for key, (crc, nbytes) in sums.items():
            path = Path(key).absolute()
            if path.is_relative_to(base):
                found[path.relative_to(base).as_posix()] = (format_crc(crc), nbytes)
        return found


class ChecksumWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that checksums its files as it writes them:
    :meth:`checksums` after ``dcp.save`` returns them."""

    def __init__(
        self, path: str | os.PathLike[str], *, sync_files: bool = True, thread_count: int = 1
    ):
        super().__init__(path, sync_files=sync_files, thread_count=thread_count)
        self.fs = ChecksumFileSystem()
        self.path = self.fs.init_path(path)

    def checksums(self) -> dict[str, tuple[str, int]]:
        """``{file name in the checkpoint: ("crc32:<8 hex>", bytes)}`` of the files this
        process wrote and checksummed in full."""
        return cast(ChecksumFileSystem, self.fs).checksums(self.path)

    def errors(self) -> list[str]:
        """The errors of this process's file writes (see :attr:`ChecksumFileSystem.errors`),
        including those of DCP's extra threads, which ``dcp.save`` does not raise."""
        fs = cast(ChecksumFileSystem, self.fs)
        with fs._lock:
            return list(fs.errors)
