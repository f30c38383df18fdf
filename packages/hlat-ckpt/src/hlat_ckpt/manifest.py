"""``hlat-checkpoint.json``: the commit record of one checkpoint, written last.

A checkpoint is complete when its manifest parses, names the step of its directory, and every
file it lists exists with the recorded size. Anything else (no manifest, a torn manifest, a
missing or truncated shard) is an incomplete checkpoint that resume skips.

The manifest also records a CRC-32 of every file, computed while the files are written on a
local disk (:mod:`hlat_ckpt.checksum_writer`) or by reading them back after they were written
(:func:`checksum_files`). :func:`verify_checksums` reads them again and compares: a file whose
bytes changed without changing its size (a flipped bit on disk, a partial overwrite) makes
the checkpoint damaged, and resume skips it like an incomplete one. Manifests written before
checksums existed have none and are checked by size only.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from .lineage import Commit, commit_from_record
from .storage import Storage

MANIFEST_NAME = "hlat-checkpoint.json"
FORMAT = "hlat-checkpoint"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "crc32"
CHECKSUM_CHUNK = 8 * 2**20  # bytes read per call while checksumming
CHECKSUM_THREADS = 4  # files checksummed at once per process (zlib and reads release the GIL)


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory that is not (or no longer) a complete checkpoint."""


class UnsupportedFormatError(RuntimeError):
    """A checkpoint whose manifest has a newer ``format_version`` than this hlat-ckpt
    reads (written by a newer release). It is never resumed, replaced or deleted: a
    checkpointer refuses to load, save or consolidate under a root that holds one."""


class DamagedCheckpointError(IncompleteCheckpointError):
    """A checkpoint whose files are all present with their sizes, but one of them no longer
    has the checksum recorded in the manifest."""


@dataclass
class Manifest:
    """The content of ``hlat-checkpoint.json``.

    ``entries`` maps each saved state name to how it was saved: ``"module"`` and
    ``"optimizer"`` (sharded through ``torch.distributed.checkpoint.state_dict``), ``"rank"``
    (one copy per rank) or ``"dict"`` (a plain dict, one copy per rank). ``files`` maps every
    file of the checkpoint (relative to its directory) to its size in bytes, and
    ``checksums`` maps them to ``"crc32:<8 hex digits>"`` (empty in manifests written before
    checksums were recorded).
    """

    step: int
    world_size: int
    entries: dict[str, str]
    files: dict[str, int]
    layout: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    checksums: dict[str, str] = field(default_factory=dict)
    lineage: dict[str, Any] = field(default_factory=dict)
    """The run lineage (:mod:`hlat_ckpt.lineage`): ``{"id", "seq", "parent", "ancestors"}``
    (``ancestors`` since hlat-ckpt 0.10); empty in manifests written before hlat-ckpt 0.5."""

    @property
    def total_bytes(self) -> int:
        """Size of all files of the checkpoint (every rank's), in bytes."""
        return sum(self.files.values())

    def to_json(self) -> bytes:
        """The manifest as UTF-8 JSON."""
        record = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "time": self.time,
            "world_size": self.world_size,
            "layout": self.layout,
            "versions": self.versions,
            "entries": self.entries,
            "files": self.files,
            "checksums": self.checksums,
            "lineage": self.lineage,
        }
        return json.dumps(record, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "manifest") -> Manifest:
        """Parse and type-check a manifest; raises :class:`IncompleteCheckpointError` saying
        what is wrong with it."""
        try:
            record = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise IncompleteCheckpointError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise IncompleteCheckpointError(f"{where}: not an {FORMAT} manifest")
        version = record.get("format_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            # Note: not an IncompleteCheckpointError, which resume skips and retention
            # deletes as an interrupted save: a newer release's checkpoint may be the
            # run's newest, and an older release must neither fall back past it nor
            # delete it
            raise UnsupportedFormatError(
                f"{where}: format_version {version}, written by a newer hlat-ckpt; this "
                f"one reads version {FORMAT_VERSION}: upgrade hlat-ckpt, or "
                "move that checkpoint out of the root to use the others (nothing was "
                "deleted)"
            )
        if version != FORMAT_VERSION:
            raise IncompleteCheckpointError(
                f"{where}: format_version {record.get('format_version')!r}; this hlat-ckpt "
                f"reads version {FORMAT_VERSION}: upgrade hlat-ckpt"
            )
        checks: dict[str, type | tuple[type, ...]] = {
            "step": int,
            "time": (int, float),
            "world_size": int,
            "layout": dict,
            "versions": dict,
            "entries": dict,
            "files": dict,
        }
        for key, kind in checks.items():
            if not isinstance(record.get(key), kind):
                raise IncompleteCheckpointError(f"{where}: field {key!r} missing or mistyped")
        files = record["files"]
        if not all(isinstance(v, int) and v >= 0 for v in files.values()):
            raise IncompleteCheckpointError(f"{where}: file sizes must be non-negative integers")
        checksums = record.get("checksums", {})  # absent in manifests of hlat-ckpt 0.1
        if not isinstance(checksums, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()
        ):
            raise IncompleteCheckpointError(f"{where}: field 'checksums' mistyped")
        lineage = record.get("lineage", {})  # absent in manifests before hlat-ckpt 0.5
        try:
            if not isinstance(lineage, dict):
                raise ValueError(f"not an object: {lineage!r}")
            commit_from_record(record["step"], "", lineage)
        except ValueError as e:
            raise IncompleteCheckpointError(f"{where}: field 'lineage' mistyped ({e})") from None
        return cls(
            step=record["step"],
            world_size=record["world_size"],
            entries=record["entries"],
            files=files,
            layout=record["layout"],
            versions=record["versions"],
            time=float(record["time"]),
            checksums=checksums,
            lineage=lineage,
        )

    def commit(self, dirname: str) -> Commit:
        """This checkpoint as :mod:`hlat_ckpt.lineage` sees it."""
        return commit_from_record(self.step, dirname, self.lineage)


def package_versions() -> dict[str, str]:
    """Versions of the packages that wrote a checkpoint (recorded for diagnosis, not checked)."""
    versions = {"python": platform.python_version()}
    for name in ("hlat-ckpt", "torch", "fsspec"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def write_manifest(storage: Storage, dirname: str, manifest: Manifest) -> None:
    """Write ``manifest`` durably into ``dirname``: on object stores this is the commit."""
    storage.write_bytes_durable(manifest.to_json(), dirname, MANIFEST_NAME)


def read_manifest(storage: Storage, dirname: str) -> Manifest:
    """The parsed manifest of ``dirname``, without checking its files."""
    where = storage.url_of(dirname, MANIFEST_NAME)
    try:
        data = storage.read_bytes(dirname, MANIFEST_NAME)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{where} does not exist (never committed)") from None
    return Manifest.from_json(data, where)


def file_checksum(storage: Storage, dirname: str, name: str) -> str:
    """``"crc32:<8 hex digits>"`` of the file ``name`` of ``dirname``, read in chunks through
    fsspec (so local paths and ``s3://`` alike, without holding the file in memory)."""
    crc = 0
    buffer = bytearray(CHECKSUM_CHUNK)
    view = memoryview(buffer)
    # Note: cache_type="none" makes each read one ranged GET on object stores, instead of
    # fsspec's read-ahead cache copying every chunk once more.
    with storage.fs.open(
        storage.path(dirname, name), "rb", block_size=CHECKSUM_CHUNK, cache_type="none"
    ) as f:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
    return f"{CHECKSUM_ALGORITHM}:{crc:08x}"


def checksum_files(storage: Storage, dirname: str, names: Iterable[str]) -> dict[str, str]:
    """``{name: checksum}`` of the files ``names`` of ``dirname`` (several at once)."""
    names = sorted(names)
    if not names:
        return {}
    with ThreadPoolExecutor(min(CHECKSUM_THREADS, len(names))) as pool:
        sums = pool.map(lambda n: file_checksum(storage, dirname, n), names)
        return dict(zip(names, sums, strict=True))


def verify_checksums(
    storage: Storage, dirname: str, manifest: Manifest, names: Iterable[str] | None = None
) -> None:
    """Read the files ``names`` (default: all with a recorded checksum) of ``dirname`` and
    compare them with ``manifest.checksums``; raises :class:`DamagedCheckpointError` naming
    every file that differs. Files without a recorded checksum are not read."""
    where = storage.url_of(dirname)
    wanted = sorted(manifest.checksums if names is None else names)
    wanted = [n for n in wanted if n in manifest.checksums and n in manifest.files]
    for name in wanted:
        algorithm = manifest.checksums[name].split(":", 1)[0]
        if algorithm != CHECKSUM_ALGORITHM:
            raise DamagedCheckpointError(
                f"{where}: file {name} has a {algorithm!r} checksum; this hlat-ckpt checks "
                f"{CHECKSUM_ALGORITHM!r}: upgrade hlat-ckpt"
            )
    actual = checksum_files(storage, dirname, wanted)
    bad = [n for n in wanted if actual[n] != manifest.checksums[n]]
    if bad:
        details = "; ".join(
            f"file {n} has checksum {actual[n]}, manifest recorded {manifest.checksums[n]}"
            for n in bad
        )
        raise DamagedCheckpointError(f"{where}: {details} (its content changed after the save)")


def validate(storage: Storage, dirname: str, step: int, *, checksums: bool = False) -> Manifest:
    """The manifest of ``dirname`` after checking that it names ``step`` and that every file it
    lists exists with the recorded size; raises :class:`IncompleteCheckpointError` otherwise.

    With ``checksums`` it also reads every file and compares its checksum with the manifest
    (:func:`verify_checksums`; a mismatch raises :class:`DamagedCheckpointError`).
    """
    manifest = read_manifest(storage, dirname)
    where = storage.url_of(dirname)
    if manifest.step != step:
        raise IncompleteCheckpointError(
            f"{where}: manifest says step {manifest.step}, directory says {step}"
        )
    present = storage.file_sizes(dirname)
    for name, size in sorted(manifest.files.items()):
        if name not in present:
            raise IncompleteCheckpointError(f"{where}: file {name} is missing")
        if present[name] != size:
            raise IncompleteCheckpointError(
                f"{where}: file {name} has {present[name]} bytes, manifest recorded {size}"
            )
    if checksums:
        verify_checksums(storage, dirname, manifest)
    return manifest


def scan(storage: Storage) -> tuple[dict[str, Manifest], dict[str, int]]:
    """Every checkpoint directory under the root, read: ``({dirname: manifest}, {dirname:
    step})``, the second for directories without a valid manifest naming their step
    (interrupted saves, write directories). The files themselves are not checked. Raises
    :class:`UnsupportedFormatError` where a checkpoint has a newer format."""
    final, leftovers = storage.list_dirs()
    manifests: dict[str, Manifest] = {}
    for dirname, step in final.items():
        try:
            manifest = read_manifest(storage, dirname)
        except IncompleteCheckpointError:
            leftovers[dirname] = step
            continue
        if manifest.step != step:
            leftovers[dirname] = step
            continue
        manifests[dirname] = manifest
    return manifests, leftovers
