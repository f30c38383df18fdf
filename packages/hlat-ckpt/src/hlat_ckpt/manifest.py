"""``hlat-checkpoint.json``: the commit record of one checkpoint, written last.

A checkpoint is complete when its manifest parses, names the step of its directory, and every
file it lists exists with the recorded size. Anything else (no manifest, a torn manifest, a
missing or truncated shard) is an incomplete checkpoint that resume skips.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from .storage import Storage

MANIFEST_NAME = "hlat-checkpoint.json"
FORMAT = "hlat-checkpoint"
FORMAT_VERSION = 1


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory that is not (or no longer) a complete checkpoint."""


@dataclass
class Manifest:
    """The content of ``hlat-checkpoint.json``.

    ``entries`` maps each saved state name to how it was saved: ``"module"`` and
    ``"optimizer"`` (sharded through ``torch.distributed.checkpoint.state_dict``), ``"rank"``
    (one copy per rank) or ``"dict"`` (a plain dict, one copy per rank). ``files`` maps every
    file of the checkpoint (relative to its directory) to its size in bytes.
    """

    step: int
    world_size: int
    entries: dict[str, str]
    files: dict[str, int]
    layout: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

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
        if record.get("format_version") != FORMAT_VERSION:
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
        return cls(
            step=record["step"],
            world_size=record["world_size"],
            entries=record["entries"],
            files=files,
            layout=record["layout"],
            versions=record["versions"],
            time=float(record["time"]),
        )


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


def validate(storage: Storage, dirname: str, step: int) -> Manifest:
    """The manifest of ``dirname`` after checking that it names ``step`` and that every file it
    lists exists with the recorded size; raises :class:`IncompleteCheckpointError` otherwise."""
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
    return manifest
