"""``Checkpointer``: sharded, atomic, async checkpoints with auto-resume on DCP."""

from __future__ import annotations

import atexit
import builtins
import os
import re
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from . import state_json
from .manifest import (
    MANIFEST_NAME,
    DamagedCheckpointError,
    IncompleteCheckpointError,
    Manifest,
    checksum_files,
    package_versions,
    read_manifest,
    validate,
    verify_checksums,
    write_manifest,
)
from .retention import incomplete_to_delete, steps_to_delete
from .rng import RNGState
from .storage import Storage, step_dirname

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp

# Note: torch.distributed.checkpoint and torch.distributed.tensor (about a second of imports
# with sympy) are imported by the methods that save and load, not with this module, so that
# a process that only lists checkpoints, or has not reached its first save, does not pay
# for them.

RNG_ENTRY = "rng"
_SHARD_FILE = re.compile(r"^__(\d+)_")  # DCP's data files: __<rank>_<n>.distcp

# Single-process saves and loads pass no_dist=True on purpose; DCP still warns about it.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)
_GLOBAL_JSON = "_global/_json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says which step, where and why."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint, as listed by :meth:`Checkpointer.list`."""

    step: int
    url: str
    time: float
    world_size: int


@dataclass(frozen=True)
class SaveStats:
    """What one committed save cost, as seen by the calling process (seconds, bytes).

    ``stall_s`` is how long :meth:`Checkpointer.save` blocked the caller: for an async save
    the wait for the previous save (``wait_s``), gathering the state dicts and the copy to
    host memory; for a synchronous save everything. ``write_s`` is the writing, checksumming
    (``checksum_s``) and commit, in the background thread for an async save; ``save_s`` runs
    from the call of ``save`` to the commit. ``bytes`` and ``files`` count every file of the
    checkpoint, all ranks' together.
    """

    step: int
    async_save: bool
    stall_s: float
    wait_s: float
    write_s: float
    checksum_s: float
    save_s: float
    bytes: int
    files: int


def _rank_prefix(rank: int) -> str:
    return f"_rank/{rank:05d}"


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def _owner(name: str, world_size: int) -> int:
    """The rank that checksums file ``name``: DCP's ``__<r>_<n>.distcp`` belong to the rank
    that wrote them (modulo the world size when it changed), everything else to rank 0."""
    m = _SHARD_FILE.match(name)
    return int(m.group(1)) % world_size if m else 0


class Checkpointer:
    """Save and resume the training state of any trainer, sharded across ranks.

    Args:
        root_url: directory or fsspec URL (``s3://bucket/run``) holding ``step_<N>/`` folders.
        keep_last: how many of the newest complete checkpoints to keep (``None``: all).
        keep_every: also keep, permanently, every step that is a multiple of this.
        async_save: return from :meth:`save` once the state is copied to host memory and
            write in a background thread.
        storage_options: fsspec options for ``root_url`` (credentials, ``client_kwargs``).
        save_rng: save and restore each rank's RNG states (:class:`RNGState`) as ``"rng"``.
        process_group: the ranks that checkpoint together; by default all ranks, through a
            new gloo group of their own.
        layout: free-form description of the parallel layout (e.g. ``{"tp": 2, "dp": 4}``),
            recorded in the manifest.
        io_threads: file-writing threads per rank on local disks.
        verify_checksums: before loading, read every file of the checkpoint and compare it
            with the checksum the manifest recorded (each rank reads the files it would
            have written); a damaged checkpoint is skipped by :meth:`load_latest` and
            refused by :meth:`load`. Checksums are always recorded.

    ``state`` maps names to the objects to checkpoint: ``nn.Module`` (also DDP/FSDP/TP
    wrapped) and ``torch.optim.Optimizer`` entries go through
    ``torch.distributed.checkpoint.state_dict``, so sharded (DTensor) parameters are saved as
    shards by each rank and load at another parallel layout. Every other object with
    ``state_dict()/load_state_dict()`` (schedulers, data loaders, counters) and plain dicts
    are saved once per rank, and must be made of tensors, NumPy arrays, numbers, strings and
    containers of them.

    Note: in a distributed job, construct the Checkpointer on every rank in the same order
    (it creates a process group), and call :meth:`wait` before
    ``destroy_process_group()``. Trust model: loading reads tensors with
    ``weights_only=True`` and other state from JSON; DCP's own ``.metadata`` file is a
    pickle, so load only checkpoints you (or your storage's access control) trust.
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        keep_last: int | None = 5,
        keep_every: int | None = None,
        async_save: bool = True,
        *,
        storage_options: dict[str, Any] | None = None,
        save_rng: bool = True,
        process_group: dist.ProcessGroup | None = None,
        layout: dict[str, Any] | None = None,
        io_threads: int = 1,
        verify_checksums: bool = True,
    ):
        if not isinstance(root_url, str | os.PathLike) or not os.fspath(root_url):
            raise TypeError(f"root_url must be a non-empty path or URL, got {root_url!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise ValueError(f"keep_every must be an int >= 1 or None, got {keep_every!r}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.save_rng = save_rng
        self.layout = dict(layout or {})
        self.io_threads = io_threads
        self.verify_checksums = verify_checksums
        self._storage = Storage(root_url, storage_options)
        self.url = self._storage.url
        if dist.is_available() and dist.is_initialized():
            # Note: a group of our own keeps background checkpoint collectives from
            # interleaving with the training loop's collectives on the default group.
            self._group: dist.ProcessGroup | None = process_group or dist.new_group(backend="gloo")
            self.rank = dist.get_rank(self._group)
            self.world_size = dist.get_world_size(self._group)
            self._src = dist.get_global_rank(self._group, 0)
        else:
            self._group = None
            self.rank, self.world_size, self._src = 0, 1, 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hlat-ckpt")
        self._pending: Future[None] | None = None
        self._pending_step = -1
        self._saved_steps: set[int] = set()  # committed by this object (storage is checked too)
        self._buffers: dict[str, torch.Tensor] = {}
        self._rng = RNGState()
        self._damaged: set[int] = set()  # steps load_latest skipped for a checksum mismatch
        self._stats_lock = threading.Lock()
        self._finished: builtins.list[SaveStats] = []
        self.last_save: SaveStats | None = None
        """What the newest committed save cost (:class:`SaveStats`)."""
        atexit.register(_wait_at_exit, weakref.ref(self))

    # --- public API ------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint ``state`` as step ``step`` (collective: every rank calls it).

        With ``async_save`` this returns once the state is copied to host memory; the files
        are written and committed in the background. Waits for the previous save first and
        raises its error, if it failed.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        started = time.perf_counter()
        entries = self._classify(state)
        self.wait()
        wait_s = time.perf_counter() - started
        if not self.async_save:
            self._prepare(step)
        elif step in self._saved_steps:
            raise CheckpointError(
                f"a checkpoint of step {step} already exists at "
                f"{self._storage.url_of(step_dirname(step))}; save each step once"
            )
        flat = self._collect(state, entries)
        layout = self._layout(flat)
        kinds = {name: kind for name, (kind, _) in entries.items()}
        if not self.async_save:
            self._write(step, flat, kinds, layout, started, None, wait_s)
            return
        staged = self._stage(flat)
        self._pending_step = step
        stall_s = time.perf_counter() - started
        self._pending = self._executor.submit(
            self._prepare_and_write, step, staged, kinds, layout, started, stall_s, wait_s
        )

    def _prepare_and_write(self, step: int, *args: Any) -> None:
        """An async save in the background: the checks and clean-up of :meth:`_prepare`
        (storage listing, a collective), then the write.

        Note: run here rather than in :meth:`save`, they would be most of what a small
        async save blocks for; the staged copy already holds the state, and nothing is
        written before they pass.
        """
        self._prepare(step)
        self._write(step, *args)

    def pop_save_stats(self) -> builtins.list[SaveStats]:
        """The :class:`SaveStats` of the saves committed since the last call, oldest first
        (an async save appears once its background write has committed)."""
        with self._stats_lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self) -> None:
        """Block until the background save (if any) has committed; raise its error if it
        failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except CheckpointError:
            raise
        except BaseException as e:
            raise CheckpointError(
                f"saving step {self._pending_step} to {self.url} failed in the background: "
                f"{type(e).__name__}: {e}"
            ) from e

    def load_latest(self, state: Mapping[str, Any]) -> int | None:
        """Load the newest complete checkpoint into ``state``; return its step, or ``None``
        when there is none (a fresh start).

        Incomplete checkpoints (no manifest, missing or truncated files) and, with
        ``verify_checksums``, damaged ones (a file whose checksum differs from the manifest's)
        are skipped with a warning. Rank 0 chooses and every rank loads the same step.
        """
        entries = self._classify(state)
        self.wait()
        rejected: set[int] = set()
        while True:
            step = -1
            if self.rank == 0:
                final, _ = self._storage.list_steps()
                for candidate in sorted(final, reverse=True):
                    if candidate in rejected:
                        continue
                    try:
                        validate(self._storage, final[candidate], candidate)
                    except IncompleteCheckpointError as e:
                        warnings.warn(f"skipping incomplete checkpoint: {e}", stacklevel=2)
                        rejected.add(candidate)
                        continue
                    step = candidate
                    break
            if self._group is not None:
                chosen = torch.tensor([step], dtype=torch.int64)
                dist.broadcast(chosen, src=self._src, group=self._group)
                step = int(chosen.item())
            if step < 0:
                return None
            manifest, problem = self._check(step)
            if manifest is not None and problem is None:
                self._read(step, manifest, entries)
                return step
            if self.rank == 0:
                warnings.warn(f"skipping damaged checkpoint: {problem}", stacklevel=2)
            self._damaged.add(step)
            rejected.add(step)

    def load(self, step: int, state: Mapping[str, Any]) -> None:
        """Load checkpoint ``step`` into ``state`` (collective).

        Entries of the checkpoint that ``state`` does not name are ignored, so a model alone
        can be loaded from a full training checkpoint. Per-rank entries need a rank of the
        same number in the saving job.
        """
        entries = self._classify(state)
        self.wait()
        manifest, problem = self._check(step)
        if manifest is None or problem is not None:
            raise CheckpointError(f"cannot load step {step}: {problem}")
        self._read(step, manifest, entries)

    def _check(self, step: int) -> tuple[Manifest | None, str | None]:
        """``(manifest, None)`` when checkpoint ``step`` is complete and, with
        ``verify_checksums``, undamaged; ``(manifest or None, what is wrong)`` otherwise.

        Collective: every rank checks the sizes and reads back the files it owns (see
        :func:`_owner`), and all ranks get the same answer. A read error other than a
        mismatch raises :class:`CheckpointError` on every rank (the checkpoint may be fine).
        """
        dirname = step_dirname(step)
        manifest: Manifest | None = None
        outcome: tuple[str, str] | None = None
        try:
            manifest = validate(self._storage, dirname, step)
            if self.verify_checksums:
                mine = [n for n in manifest.checksums if _owner(n, self.world_size) == self.rank]
                verify_checksums(self._storage, dirname, manifest, mine)
        except IncompleteCheckpointError as e:
            outcome = ("damaged", str(e))
        except Exception as e:
            outcome = ("error", f"rank {self.rank}: {type(e).__name__}: {e}")
        outcomes = [outcome]
        if self._group is not None:
            outcomes = [None] * self.world_size
            dist.all_gather_object(outcomes, outcome, group=self._group)
        errors = [o[1] for o in outcomes if o is not None and o[0] == "error"]
        if errors:
            raise CheckpointError(
                f"checking {self._storage.url_of(dirname)} failed: {'; '.join(errors)}"
            )
        problems = [o[1] for o in outcomes if o is not None]
        return manifest, problems[0] if problems else None

    def _read(self, step: int, manifest: Manifest, entries: dict[str, tuple[str, Any]]) -> None:
        import torch.distributed.checkpoint as dcp

        dirname = step_dirname(step)
        where = self._storage.url_of(dirname)
        for name, (kind, _) in list(entries.items()):
            saved = manifest.entries.get(name)
            if saved is None:
                if name == RNG_ENTRY and kind == "rank":
                    del entries[name]
                    continue
                raise CheckpointError(
                    f"{where} has no entry {name!r} (it has {sorted(manifest.entries)}); "
                    "remove it from the state to load the others"
                )
            if saved != kind:
                raise CheckpointError(f"{where}: entry {name!r} was saved as {saved}, not {kind}")

        reader = self._reader(dirname)
        metadata = reader.read_metadata().state_dict_metadata
        request: dict[str, torch.Tensor] = {_GLOBAL_JSON: _placeholder(metadata, _GLOBAL_JSON)}
        current: dict[str, dict[str, torch.Tensor]] = {}
        for name, (kind, obj) in entries.items():
            if kind in ("module", "optimizer"):
                _, tensors = state_json.split(self._get_state_dict(kind, obj), name)
                absent = [k for k in tensors if k not in metadata]
                if absent:
                    raise CheckpointError(
                        f"{where}: entry {name!r} lacks {len(absent)} tensors of the current "
                        f"{kind}, e.g. {absent[:3]}; was it saved from a different model?"
                    )
                current[name] = tensors
                request.update(tensors)
        per_rank = [n for n, (kind, _) in entries.items() if kind in ("rank", "dict")]
        rank_json = f"{_rank_prefix(self.rank)}/_json"
        if per_rank:
            if rank_json not in metadata:
                raise CheckpointError(
                    f"{where} was written by {manifest.world_size} ranks and has no per-rank "
                    f"state for rank {self.rank}; to change the number of ranks, load only the "
                    f"model and optimizer entries (leave out {per_rank})"
                )
            request[rank_json] = _placeholder(metadata, rank_json)
            for name in per_rank:
                prefix = f"{_rank_prefix(self.rank)}/{name}/"
                for key in metadata:
                    if key.startswith(prefix):
                        request[key] = _placeholder(metadata, key)

        try:
            dcp.load(
                request,
                storage_reader=reader,
                process_group=self._group,
                no_dist=self._group is None,
            )
        except Exception as e:
            raise CheckpointError(f"reading {where} failed: {type(e).__name__}: {e}") from e

        global_skel = state_json.loads(_tensor_bytes(request[_GLOBAL_JSON]))
        rank_skel = state_json.loads(_tensor_bytes(request[rank_json])) if per_rank else {}
        for name, (kind, obj) in entries.items():
            if kind in ("module", "optimizer"):
                value = state_json.join(global_skel[name], current[name], f"{where}:{name}")
                self._set_state_dict(kind, obj, value)
            else:
                value = state_json.join(rank_skel[name], request, f"{where}:{name}")
                if kind == "dict":
                    obj.clear()
                    obj.update(value)
                else:
                    obj.load_state_dict(value)

    def list(self) -> builtins.list[CheckpointInfo]:
        """The committed checkpoints under the root, oldest first (manifests are read; shard
        files are not checked, see :meth:`load_latest`)."""
        final, _ = self._storage.list_steps()
        found = []
        for step in sorted(final):
            try:
                manifest = read_manifest(self._storage, final[step])
            except IncompleteCheckpointError:
                continue
            found.append(
                CheckpointInfo(
                    step, self._storage.url_of(final[step]), manifest.time, manifest.world_size
                )
            )
        return found

    def close(self) -> None:
        """Wait for the last save and stop the background writer."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- save internals --------------------------------------------------------------------

    def _classify(self, state: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
        if not isinstance(state, Mapping):
            raise TypeError(f"state must map names to objects, got {type(state).__name__}")
        entries: dict[str, tuple[str, Any]] = {}
        for name, obj in state.items():
            if not isinstance(name, str) or not name or "/" in name or name.startswith("_"):
                raise ValueError(
                    f"state name {name!r}: use a non-empty str without '/' that does not start "
                    "with '_'"
                )
            if isinstance(obj, nn.Module):
                entries[name] = ("module", obj)
            elif isinstance(obj, torch.optim.Optimizer):
                entries[name] = ("optimizer", (self._model_of(name, obj, state), obj))
            elif callable(getattr(obj, "state_dict", None)) and callable(
                getattr(obj, "load_state_dict", None)
            ):
                entries[name] = ("rank", obj)
            elif isinstance(obj, dict):
                entries[name] = ("dict", obj)
            else:
                raise TypeError(
                    f"state[{name!r}] is a {type(obj).__name__}: pass an nn.Module, an "
                    "Optimizer, an object with state_dict()/load_state_dict(), or a dict"
                )
        if self.save_rng and RNG_ENTRY not in entries:
            entries[RNG_ENTRY] = ("rank", self._rng)
        return entries

    @staticmethod
    def _model_of(
        name: str, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> nn.Module:
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for obj in state.values():
            if isinstance(obj, nn.Module) and wanted <= {id(p) for p in obj.parameters()}:
                return obj
        raise ValueError(
            f"state[{name!r}] is an optimizer but no nn.Module in the state owns all of its "
            "parameters; add the model to the same state"
        )

    @staticmethod
    def _get_state_dict(kind: str, obj: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        if kind == "module":
            return get_model_state_dict(obj)
        model, optimizer = obj
        return get_optimizer_state_dict(model, optimizer)

    @staticmethod
    def _set_state_dict(kind: str, obj: Any, value: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if kind == "module":
            set_model_state_dict(obj, value, options=StateDictOptions(strict=True))
        else:
            model, optimizer = obj
            set_optimizer_state_dict(model, optimizer, value)

    def _prepare(self, step: int) -> None:
        # Rank 0 clears leftovers of an interrupted save of this step before anyone writes.
        exists = 0
        if self.rank == 0:
            final, tmp = self._storage.list_steps()
            if step in final:
                try:
                    # Note: a damaged checkpoint (a shard cut short, or one whose checksum
                    # no longer matches) was skipped by load_latest, so the resumed run
                    # reaches this step again: replace it.
                    if step in self._damaged:
                        raise DamagedCheckpointError(f"step {step} failed its checksums")
                    validate(self._storage, final[step], step)
                    exists = 1
                except IncompleteCheckpointError:
                    self._storage.remove_dir(final[step])
            if step in tmp:
                self._storage.remove_dir(tmp[step])
        steps = [step]
        if self._group is not None:
            mine = torch.tensor([step, exists], dtype=torch.int64)
            gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine, group=self._group)
            steps = [int(t[0]) for t in gathered]
            exists = int(gathered[0][1])
        if len(set(steps)) != 1:
            raise CheckpointError(f"ranks called save() with different steps: {steps}")
        if exists:
            raise CheckpointError(
                f"a checkpoint of step {step} already exists at "
                f"{self._storage.url_of(step_dirname(step))}; save each step once (delete it "
                "to save it again)"
            )

    def _collect(
        self, state: Mapping[str, Any], entries: dict[str, tuple[str, Any]]
    ) -> dict[str, torch.Tensor]:
        flat: dict[str, torch.Tensor] = {}
        global_skel: dict[str, Any] = {}
        rank_skel: dict[str, Any] = {}
        prefix = _rank_prefix(self.rank)
        for name, (kind, obj) in entries.items():
            if kind in ("module", "optimizer"):
                skel, tensors = state_json.split(self._get_state_dict(kind, obj), name)
                global_skel[name] = skel
            else:
                value = dict(obj) if kind == "dict" else obj.state_dict()
                skel, tensors = state_json.split(value, f"{prefix}/{name}")
                rank_skel[name] = skel
            flat.update(tensors)
        # Serialised now, so later changes to the live objects cannot leak into an async save.
        flat[f"{prefix}/_json"] = _bytes_tensor(state_json.dumps(rank_skel))
        if self.rank == 0:
            flat[_GLOBAL_JSON] = _bytes_tensor(state_json.dumps(global_skel))
        return flat

    def _layout(self, flat: dict[str, torch.Tensor]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        meshes = []
        for t in flat.values():
            if isinstance(t, DTensor):
                mesh = t.device_mesh
                desc = {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())}
                if desc not in meshes:
                    meshes.append(desc)
        return {**self.layout, "meshes": meshes}

    def _stage(self, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy every tensor into host buffers reused from the previous save.

        Note: reusing the buffers is what keeps the stall small: fresh allocations of the
        same size cost page faults that take longer than the copy itself.
        """
        from torch.distributed.tensor import DTensor

        staged: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        on_device = False
        for key, t in flat.items():
            local = t.to_local() if isinstance(t, DTensor) else t
            buf = self._buffers.get(key)
            device_resident = local.device.type != "cpu"
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = _host_buffer(local, pinned=device_resident)
            buf.copy_(local.detach(), non_blocking=device_resident and buf.is_pinned())
            on_device |= device_resident
            buffers[key] = buf
            if isinstance(t, DTensor):
                staged[key] = DTensor.from_local(
                    buf,
                    t.device_mesh,
                    t.placements,
                    run_check=False,
                    shape=t.shape,
                    stride=t.stride(),
                )
            else:
                staged[key] = buf
        if on_device:
            torch.accelerator.synchronize()  # the non-blocking copies above have landed
        self._buffers = buffers
        return staged

    def _writer(self, dirname: str) -> dcp.StorageWriter:
        import torch.distributed.checkpoint as dcp

        if self._storage.is_local:
            return dcp.FileSystemWriter(
                self._storage.path(dirname), sync_files=True, thread_count=self.io_threads
            )
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(
            self._storage.url_of(dirname), sync_files=True, **self._storage.storage_options
        )

    def _reader(self, dirname: str) -> dcp.StorageReader:
        import torch.distributed.checkpoint as dcp

        if self._storage.is_local:
            return dcp.FileSystemReader(self._storage.path(dirname))
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self._storage.url_of(dirname), **self._storage.storage_options)

    def _write(
        self,
        step: int,
        flat: dict[str, torch.Tensor],
        kinds: dict[str, str],
        layout: dict[str, Any],
        started: float,
        stall_s: float | None,
        wait_s: float,
    ) -> None:
        """Write, checksum and commit ``step`` (collective; in the background thread for an
        async save), then record its :class:`SaveStats`."""
        import torch.distributed.checkpoint as dcp

        write_start = time.perf_counter()
        dirname = self._storage.write_dirname(step)
        final = step_dirname(step)
        where = self._storage.url_of(final)
        try:
            self._storage.makedirs(dirname)
            dcp.save(
                flat,
                storage_writer=self._writer(dirname),
                process_group=self._group,
                no_dist=self._group is None,
            )
        except BaseException as e:
            if self.rank == 0:
                self._discard(dirname)
            raise CheckpointError(
                f"writing step {step} to {where} failed: {type(e).__name__}: {e}; earlier "
                "checkpoints are untouched"
            ) from e
        # DCP's final collective returns only after every rank's files and the metadata are
        # written, so rank 0 can now list the files; each rank checksums its own.
        checksum_start = time.perf_counter()
        error: BaseException | None = None
        sizes: dict[str, int] = {}
        if self.rank == 0:
            try:
                sizes = self._storage.file_sizes(dirname)
            except BaseException as e:
                error = e
        names: builtins.list[Any] = [sorted(sizes) if error is None else None]
        if self._group is not None:
            dist.broadcast_object_list(names, src=self._src, group=self._group)
        sums: dict[str, str] = {}
        problem: str | None = None
        if names[0] is not None:
            mine = [n for n in names[0] if _owner(n, self.world_size) == self.rank]
            try:
                sums = checksum_files(self._storage, dirname, mine)
            except Exception as e:
                problem = f"rank {self.rank} could not checksum its files: {type(e).__name__}: {e}"
        gathered: builtins.list[Any] = [(sums, problem)]
        if self._group is not None:
            gathered = [None] * self.world_size if self.rank == 0 else []
            dist.gather_object(
                (sums, problem),
                gathered if self.rank == 0 else None,
                dst=self._src,
                group=self._group,
            )
        checksum_s = time.perf_counter() - checksum_start
        total = [0, 0]
        if self.rank == 0 and error is None:
            try:
                problems = [p for _, p in gathered if p]
                if problems:
                    raise CheckpointError("; ".join(problems))
                checksums = {name: value for part, _ in gathered for name, value in part.items()}
                missing = sorted(set(sizes) - set(checksums))
                if missing:
                    raise CheckpointError(f"no checksum for {missing}")
                manifest = Manifest(
                    step=step,
                    world_size=self.world_size,
                    entries=kinds,
                    files=sizes,
                    layout=layout,
                    versions=package_versions(),
                    checksums=checksums,
                )
                write_manifest(self._storage, dirname, manifest)
                self._storage.commit_dir(dirname, final)
                total = [manifest.total_bytes, len(manifest.files)]
            except BaseException as e:
                error = e
        if error is not None:
            self._discard(dirname)
        failed = error is not None
        if self._group is not None:
            flag = torch.tensor([int(failed), *total], dtype=torch.int64)
            dist.broadcast(flag, src=self._src, group=self._group)
            failed = bool(flag[0].item())
            total = [int(flag[1].item()), int(flag[2].item())]
        if failed:
            detail = f"{type(error).__name__}: {error}" if error is not None else "see rank 0"
            raise CheckpointError(
                f"committing step {step} to {where} failed: {detail}; earlier checkpoints are "
                "untouched"
            ) from error
        if self.rank == 0:
            self._damaged.discard(step)
            self._retain(step)
        end = time.perf_counter()
        stats = SaveStats(
            step=step,
            async_save=stall_s is not None,
            stall_s=end - started if stall_s is None else stall_s,
            wait_s=wait_s,
            write_s=end - write_start,
            checksum_s=checksum_s,
            save_s=end - started,
            bytes=total[0],
            files=total[1],
        )
        with self._stats_lock:
            self._finished.append(stats)
            self.last_save = stats
            self._saved_steps.add(step)

    def _discard(self, dirname: str) -> None:
        try:
            self._storage.remove_dir(dirname)
        except Exception as e:  # the original error matters more than the cleanup's
            warnings.warn(f"could not remove {self._storage.url_of(dirname)}: {e}", stacklevel=2)

    def _retain(self, committed: int) -> None:
        final, tmp = self._storage.list_steps()
        complete: dict[int, str] = {}
        leftovers: dict[int, str] = {s: d for s, d in tmp.items() if s != committed}
        for s, d in final.items():
            try:
                read_manifest(self._storage, d)
                if s in self._damaged:  # skipped by load_latest: not one to keep
                    raise DamagedCheckpointError(f"step {s} failed its checksums")
                complete[s] = d
            except IncompleteCheckpointError:
                leftovers.setdefault(s, d)
        doomed = [
            complete[s]
            for s in steps_to_delete(complete, committed, self.keep_last, self.keep_every)
        ]
        doomed += [leftovers[s] for s in incomplete_to_delete(leftovers, committed)]
        for dirname in doomed:
            try:
                # Manifest first: a deletion cut short leaves an incomplete checkpoint that
                # resume skips, never one that looks complete but lacks files.
                self._storage.remove_file(dirname, MANIFEST_NAME)
                self._storage.remove_dir(dirname)
            except Exception as e:
                warnings.warn(
                    f"retention could not delete {self._storage.url_of(dirname)}: {e}",
                    stacklevel=2,
                )


def _placeholder(metadata: Mapping[str, Any], key: str) -> torch.Tensor:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    item = metadata.get(key)
    if not isinstance(item, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint has no tensor {key!r}; it was not written by hlat-ckpt")
    return torch.empty(item.size, dtype=item.properties.dtype)


def _wait_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    checkpointer = ref()
    if checkpointer is None:
        return
    try:
        checkpointer.wait()
    except Exception:
        traceback.print_exc()
        print("hlat-ckpt: the last checkpoint was not saved (see above)", file=sys.stderr)


def _host_buffer(like: torch.Tensor, pinned: bool) -> torch.Tensor:
    """An empty CPU tensor shaped like ``like``; page-locked when it receives a copy from an
    accelerator (so the copy runs without blocking) and the device's runtime can pin."""
    if pinned:
        try:
            return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)
        except RuntimeError:  # a backend without pinned host memory
            pass
    return torch.empty(like.shape, dtype=like.dtype, device="cpu")
