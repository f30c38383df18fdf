"""fsspec glue: where checkpoint directories live and how one becomes visible.

On a local (POSIX) file system a checkpoint is written into ``step_<N>.tmp`` and renamed to
``step_<N>`` once complete, so a half-written directory never carries the final name. Object
stores have no atomic directory rename, so there the data is written in place and the
manifest, written last, is the commit (see :mod:`hlat_ckpt.manifest`).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

_STEP_DIR = re.compile(r"^step_(\d+)(?:-([0-9a-z]+))?$")
_TMP_SUFFIX = ".tmp"
_GLOB = re.compile(r"[*?[]")  # what fsspec's rm (and copy, mv) expands as a pattern
STEP_DIGITS = 10


def step_dirname(step: int, tag: str = "") -> str:
    """The directory name of ``step``: ``step_`` and the step zero-padded to 10 digits, so that
    names sort like steps; ``step_<N>-<tag>`` for a second checkpoint of the same step (a new
    lineage saving a step that an abandoned one also saved, see :mod:`hlat_ckpt.lineage`)."""
    name = f"step_{step:0{STEP_DIGITS}d}"
    return f"{name}-{tag}" if tag else name


def parse_dirname(name: str) -> int | None:
    """The step of a checkpoint directory name (``step_<N>`` or ``step_<N>-<tag>``), or
    ``None`` for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def check_object_store_root(url: str, root: str) -> None:
    """Raise ``ValueError`` where the object-store checkpoint root ``url`` (``root``: its
    path, without the protocol) holds ``*``, ``?`` or ``[``. Pure: no file system is opened.

    Note: DCP's fsspec writer renames and cleans up through fsspec, which expands these as
    patterns: a failed write could delete another root's files."""
    if _GLOB.search(root):
        raise ValueError(
            f"{url}: an object-store checkpoint root cannot contain '*', '?' or '[' "
            "(fsspec reads them as patterns); choose another name"
        )


class Storage:
    """A checkpoint root (a local path or any fsspec URL such as ``s3://bucket/run``).

    ``storage_options`` are passed to fsspec (for s3fs: ``key``, ``secret``,
    ``client_kwargs={"endpoint_url": ...}``, ...).
    """

    def __init__(
        self, root_url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
    ):
        self.url = os.fspath(root_url).rstrip("/") or "/"
        self.storage_options = dict(storage_options or {})
        self.fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if self.is_local:
            self.root = os.path.abspath(self.root)
        else:
            check_object_store_root(self.url, self.root)

    # --- names -----------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        """The file-system path (as fsspec names it) of ``parts`` under the root."""
        return "/".join([self.root, *parts])

    def url_of(self, *parts: str) -> str:
        """The URL (with protocol) of ``parts`` under the root, as DCP's fsspec writer wants it."""
        if self.is_local:
            return self.path(*parts)
        return "/".join([self.url, *parts])

    def write_dirname(self, name: str) -> str:
        """Where the shards of the checkpoint directory ``name`` are written before the commit."""
        return f"{name}{_TMP_SUFFIX}" if self.is_local else name

    def list_dirs(self) -> tuple[dict[str, int], dict[str, int]]:
        """``({dirname: step}, {tmp dirname: step})`` of the checkpoint directories under the
        root (several directories may hold the same step, see :func:`step_dirname`)."""
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return {}, {}
        final: dict[str, int] = {}
        tmp: dict[str, int] = {}
        for name in names:
            if (step := parse_dirname(name)) is not None:
                final[name] = step
            elif (step := parse_dirname(name.removesuffix(_TMP_SUFFIX))) is not None:
                tmp[name] = step
        return final, tmp

    # --- files -----------------------------------------------------------------------------

    def makedirs(self, *parts: str) -> None:
        """Create the directory ``parts`` (a no-op on object stores, which have no directories)."""
        self.fs.makedirs(self.path(*parts), exist_ok=True)

    def exists(self, *parts: str) -> bool:
        """Whether ``parts`` exists under the root."""
        return bool(self.fs.exists(self.path(*parts)))

    def read_bytes(self, *parts: str) -> bytes:
        """The content of the file ``parts``."""
        return bytes(self.fs.cat_file(self.path(*parts)))

    def write_bytes_durable(self, data: bytes, *parts: str) -> None:
        """Write a small file so that it is either absent or complete and on stable storage.

        Note: locally the data goes to a temporary name, is fsynced and then renamed over the
        target, and the directory is fsynced; an object-store PUT is already all-or-nothing.
        """
        target = self.path(*parts)
        if not self.is_local:
            self.fs.pipe_file(target, data)
            return
        tmp = f"{target}.{uuid.uuid4().hex[:8]}.part"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(os.path.dirname(target))

    def file_sizes(self, *parts: str) -> dict[str, int]:
        """``{relative path: size in bytes}`` of every file under the directory ``parts``."""
        base = self.path(*parts)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        prefix = base.rstrip("/") + "/"
        sizes: dict[str, int] = {}
        for path, info in found.items():
            if info.get("type", "file") != "file":
                continue
            rel = path[len(prefix) :] if path.startswith(prefix) else path.rsplit("/", 1)[-1]
            sizes[rel] = int(info["size"])
        return sizes

    def commit_dir(self, write_dirname: str, final_dirname: str) -> None:
        """Make a fully written directory visible under its final name (local: atomic rename)."""
        if write_dirname == final_dirname:
            return
        os.rename(self.path(write_dirname), self.path(final_dirname))
        _fsync_dir(self.root)

    def remove_file(self, *parts: str) -> None:
        """Delete one file if it exists (``rm_file`` takes the path as it is, no pattern)."""
        path = self.path(*parts)
        if self.fs.exists(path):
            self.fs.rm_file(path)

    def remove_dir(self, *parts: str) -> None:
        """Delete a directory and everything in it, if it exists."""
        path = self.path(*parts)
        if not self.fs.exists(path):
            return
        if self.is_local:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            return
        self.fs.rm(path, recursive=True)  # the root holds no pattern characters


def _fsync_dir(path: str) -> None:
    # A rename or create is durable only once the directory entry itself is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
