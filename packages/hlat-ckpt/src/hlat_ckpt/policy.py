"""What a checkpoint is, whatever engine writes its files: :class:`CheckpointPolicy`.

A checkpoint is complete once its manifest (:mod:`hlat_ckpt.manifest`, every file's size and
checksum) is written after the engine's files; resume takes the newest complete, undamaged
one; retention runs only after a commit. The engines, :class:`~hlat_ckpt.Checkpointer`
(torch.distributed.checkpoint) and :class:`~hlat_ckpt.neuron.NeuronCheckpointer` (NeuronX
Distributed), only write a step's files and read them back.
"""

from __future__ import annotations

import atexit
import builtins
import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

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
from .storage import Storage, step_dirname


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says which step, where and why."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint, as listed by :meth:`~hlat_ckpt.Checkpointer.list`."""

    step: int
    url: str
    time: float
    world_size: int


@dataclass(frozen=True)
class SaveStats:
    """What one committed save cost, as seen by the calling process (seconds, bytes).

    ``stall_s`` is how long :meth:`~hlat_ckpt.Checkpointer.save` blocked the caller: for an
    async save the wait for the previous save (``wait_s``), gathering the state dicts and the
    copy to host memory; for a synchronous save everything. ``write_s`` is the writing,
    checksumming (``checksum_s``) and commit, in the background thread for an async save;
    ``save_s`` runs from the call of ``save`` to the commit. ``bytes`` and ``files`` count
    every file of the checkpoint, all ranks' together.
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


@dataclass
class Written:
    """A save whose files are written (or still being written by the engine), not committed."""

    step: int
    entries: dict[str, str]
    layout: dict[str, Any]
    started: float
    stall_s: float | None
    """How long save() blocked; ``None`` for a synchronous save (it blocked throughout)."""
    wait_s: float
    write_start: float


PendingT = TypeVar("PendingT")
PolicyT = TypeVar("PolicyT", bound="CheckpointPolicy[Any]")


class CheckpointPolicy(Generic[PendingT]):
    """The guarantees every checkpointer of hlat-ckpt keeps, whatever engine writes the files.

    Two engines, one set of guarantees: :class:`~hlat_ckpt.Checkpointer` writes through
    torch.distributed.checkpoint and :class:`~hlat_ckpt.neuron.NeuronCheckpointer` through
    NeuronX Distributed, and a run must resume, skip a torn or damaged checkpoint and prune
    old ones the same way on either. So the choice of the checkpoint to resume (rank 0
    chooses, every rank loads the same step), the checks (:func:`~hlat_ckpt.manifest.validate`
    and the checksums), the commit (the manifest), retention, listing, the save statistics
    and the lifecycle (:meth:`wait`, :meth:`close`, the context manager, the wait at exit)
    live here once, and an engine implements only:

    - how a step is written, in its ``save`` and :meth:`_finish` (what a pending save
      ``PendingT`` is and how it completes), handing the written files to :meth:`_commit`;
    - how a step's files are read back into the state: :meth:`_resolve` and :meth:`_read`;
    - which files a rank checksums: :meth:`_checksum_share`;
    - what its files need besides the manifest: :meth:`_check_written`, :meth:`_abandon`,
      :attr:`_markers`.
    """

    _markers: tuple[str, ...] = (MANIFEST_NAME,)
    """The files whose presence makes a checkpoint look complete (to hlat-ckpt or to the
    engine), deleted in this order before the rest of a checkpoint."""
    _after_failed_commit = "earlier checkpoints are untouched"
    """What a failed commit leaves, for its error message."""

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        keep_last: int | None,
        keep_every: int | None,
        async_save: bool,
        *,
        storage_options: dict[str, Any] | None,
        save_rng: bool,
        process_group: dist.ProcessGroup | None,
        layout: dict[str, Any],
        verify_checksums: bool,
    ):
        if not isinstance(root_url, str | os.PathLike) or not os.fspath(root_url):
            raise TypeError(f"root_url must be a non-empty path or URL, got {root_url!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise ValueError(f"keep_every must be an int >= 1 or None, got {keep_every!r}")
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.save_rng = save_rng
        self.layout = layout
        self.verify_checksums = verify_checksums
        self._storage = Storage(root_url, storage_options)
        self.url = self._storage.url
        if dist.is_available() and dist.is_initialized():
            # Note: a gloo group of our own: background checkpoint collectives must not
            # interleave with the training loop's on the default group, and the bookkeeping
            # exchanges host values that must not enter a device's (XLA) traced graph.
            self._group: dist.ProcessGroup | None = process_group or dist.new_group(backend="gloo")
            self.rank = dist.get_rank(self._group)
            self.world_size = dist.get_world_size(self._group)
            self._src = dist.get_global_rank(self._group, 0)
        else:
            self._group = None
            self.rank, self.world_size, self._src = 0, 1, 0
        self._pending: PendingT | None = None
        self._saved_steps: set[int] = set()  # committed by this object (storage is checked too)
        self._damaged: set[int] = set()  # steps load_latest skipped for a checksum mismatch
        self._stats_lock = threading.Lock()  # commits may run in an engine's background thread
        self._finished: builtins.list[SaveStats] = []
        self.last_save: SaveStats | None = None
        """What the newest committed save cost (:class:`~hlat_ckpt.SaveStats`)."""
        atexit.register(_wait_at_exit, weakref.ref(self))

    # --- engine hooks ----------------------------------------------------------------------

    def _finish(self, pending: PendingT) -> None:
        """Complete the pending save ``pending`` up to its commit, or raise
        :class:`CheckpointError`."""
        raise NotImplementedError

    def _resolve(self, state: Mapping[str, Any]) -> Any:
        """Check ``state`` (raising ``TypeError``/``ValueError`` before anything is read)
        and return what :meth:`_read` takes."""
        raise NotImplementedError

    def _read(self, step: int, manifest: Manifest, resolved: Any) -> None:
        """Read checkpoint ``step``, checked against ``manifest``, into the state (collective)."""
        raise NotImplementedError

    def _checksum_share(self, names: builtins.list[str]) -> builtins.list[str]:
        """Which of a checkpoint's files ``names`` this rank checksums; every file is some
        rank's."""
        raise NotImplementedError

    def _check_written(self, sizes: dict[str, int], where: str) -> None:
        """Raise if the files ``sizes`` of a written step are not all the engine wrote."""

    def _abandon(self, dirname: str) -> None:
        """Deal with the files of a step whose commit failed (on rank 0)."""

    # --- public API ------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until the pending save (if any) is committed; raise
        :class:`~hlat_ckpt.CheckpointError` if it failed. Call it on every rank: an engine
        may commit here, which is collective."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._finish(pending)

    def pop_save_stats(self) -> builtins.list[SaveStats]:
        """The :class:`~hlat_ckpt.SaveStats` of the saves committed since the last call,
        oldest first (an async save appears once it has committed)."""
        with self._stats_lock:
            finished, self._finished = self._finished, []
        return finished

    def load_latest(self, state: Mapping[str, Any]) -> int | None:
        """Load the newest complete checkpoint into ``state``; return its step, or ``None``
        when there is none (a fresh start).

        Incomplete checkpoints (no manifest, missing or truncated files; an engine's own
        marker alone does not make one complete) and, with ``verify_checksums``, damaged
        ones (a file whose checksum differs from the manifest's) are skipped with a warning.
        Rank 0 chooses and every rank loads the same step.
        """
        resolved = self._resolve(state)
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
                self._read(step, manifest, resolved)
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
        resolved = self._resolve(state)
        self.wait()
        manifest, problem = self._check(step)
        if manifest is None or problem is not None:
            raise CheckpointError(f"cannot load step {step}: {problem}")
        self._read(step, manifest, resolved)

    def list(self) -> builtins.list[CheckpointInfo]:
        """The committed checkpoints under the root, oldest first (manifests are read; the
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
        """Wait for the last save to commit."""
        self.wait()

    def __enter__(self: PolicyT) -> PolicyT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- resume ----------------------------------------------------------------------------

    def _check(self, step: int) -> tuple[Manifest | None, str | None]:
        """``(manifest, None)`` when checkpoint ``step`` is complete and, with
        ``verify_checksums``, undamaged; ``(manifest or None, what is wrong)`` otherwise.

        Collective: every rank checks the sizes and reads back its share of the files (see
        :meth:`_checksum_share`), and all ranks get the same answer. A read error other than
        a mismatch raises :class:`CheckpointError` on every rank (the checkpoint may be fine).
        """
        dirname = step_dirname(step)
        manifest: Manifest | None = None
        outcome: tuple[str, str] | None = None
        try:
            manifest = validate(self._storage, dirname, step)
            if self.verify_checksums:
                mine = self._checksum_share(builtins.list(manifest.checksums))
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

    def _check_entries(self, where: str, manifest: Manifest, kinds: Mapping[str, str]) -> None:
        """Refuse to load entries ``kinds`` (name: kind) that the checkpoint at ``where``
        lacks or saved as another kind."""
        for name, kind in kinds.items():
            saved = manifest.entries.get(name)
            if saved is None:
                raise CheckpointError(
                    f"{where} has no entry {name!r} (it has {sorted(manifest.entries)}); "
                    "remove it from the state to load the others"
                )
            if saved != kind:
                raise CheckpointError(f"{where}: entry {name!r} was saved as {saved}, not {kind}")

    # --- commit ----------------------------------------------------------------------------

    def _refuse_saved(self, step: int) -> None:
        """Refuse a step this object has committed already (without a look at the storage)."""
        if step in self._saved_steps:
            raise CheckpointError(
                f"a checkpoint of step {step} already exists at "
                f"{self._storage.url_of(step_dirname(step))}; save each step once"
            )

    def _prepare(self, step: int) -> None:
        """Refuse a step already committed; clear leftovers of an interrupted save of it
        (rank 0, before anyone writes). Collective."""
        exists = 0
        if self.rank == 0:
            final, tmp = self._storage.list_steps()
            if step in final:
                try:
                    # Note: a damaged checkpoint (a file cut short, or one whose checksum
                    # no longer matches) was skipped by load_latest, so the resumed run
                    # reaches this step again: replace it.
                    if step in self._damaged:
                        raise DamagedCheckpointError(f"step {step} failed its checksums")
                    validate(self._storage, final[step], step)
                    exists = 1
                except IncompleteCheckpointError:
                    # Note: the engine's files and markers (NxD's done) would otherwise
                    # survive into the new save, and a stale marker would mark it finished
                    # too early.
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

    def _commit(self, dirname: str, written: Written) -> None:
        """Checksum the files every rank wrote into ``dirname`` for ``written.step``, write
        the manifest (the commit), make the directory final, apply retention and record the
        :class:`SaveStats`. Collective; once every rank's files are written."""
        step = written.step
        final = step_dirname(step)
        where = self._storage.url_of(final)
        checksum_start = time.perf_counter()
        error: BaseException | None = None
        sizes: dict[str, int] = {}
        if self.rank == 0:
            try:
                sizes = self._storage.file_sizes(dirname)
                self._check_written(sizes, where)
            except BaseException as e:
                error = e
        names: builtins.list[Any] = [sorted(sizes) if error is None else None]
        if self._group is not None:
            dist.broadcast_object_list(names, src=self._src, group=self._group)
        sums: dict[str, str] = {}
        problem: str | None = None
        if names[0] is not None:
            try:
                sums = checksum_files(self._storage, dirname, self._checksum_share(names[0]))
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
                    entries=written.entries,
                    files=sizes,
                    layout=written.layout,
                    versions=package_versions(),
                    checksums=checksums,
                )
                write_manifest(self._storage, dirname, manifest)
                self._storage.commit_dir(dirname, final)
                total = [manifest.total_bytes, len(manifest.files)]
            except BaseException as e:
                error = e
        if error is not None:
            self._abandon(dirname)
        failed = error is not None
        if self._group is not None:
            flag = torch.tensor([int(failed), *total], dtype=torch.int64)
            dist.broadcast(flag, src=self._src, group=self._group)
            failed = bool(flag[0].item())
            total = [int(flag[1].item()), int(flag[2].item())]
        if failed:
            detail = f"{type(error).__name__}: {error}" if error is not None else "see rank 0"
            raise CheckpointError(
                f"committing step {step} to {where} failed: {detail}; {self._after_failed_commit}"
            ) from error
        if self.rank == 0:
            self._damaged.discard(step)
            self._retain(step)
        end = time.perf_counter()
        synchronous = written.stall_s is None
        stats = SaveStats(
            step=step,
            async_save=not synchronous,
            stall_s=end - written.started if written.stall_s is None else written.stall_s,
            wait_s=written.wait_s,
            write_s=end - written.write_start,
            checksum_s=checksum_s,
            save_s=end - written.started,
            bytes=total[0],
            files=total[1],
        )
        with self._stats_lock:
            self._finished.append(stats)
            self.last_save = stats
            self._saved_steps.add(step)

    # --- retention -------------------------------------------------------------------------

    def _retain(self, committed: int) -> None:
        """Delete what keep_last/keep_every no longer keep and leftovers of other saves,
        just after ``committed`` was committed (rank 0)."""
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
                # Markers first: a deletion cut short leaves an incomplete checkpoint that
                # neither resume nor the engine takes for complete, never one that looks
                # complete but lacks files.
                for marker in self._markers:
                    self._storage.remove_file(dirname, marker)
                self._storage.remove_dir(dirname)
            except Exception as e:
                warnings.warn(
                    f"retention could not delete {self._storage.url_of(dirname)}: {e}",
                    stacklevel=2,
                )


def _wait_at_exit(ref: weakref.ref[CheckpointPolicy[Any]]) -> None:
    checkpointer = ref()
    if checkpointer is None:
        return
    try:
        checkpointer.wait()
    except Exception:
        traceback.print_exc()
        print("hlat-ckpt: the last checkpoint was not committed (see above)", file=sys.stderr)
