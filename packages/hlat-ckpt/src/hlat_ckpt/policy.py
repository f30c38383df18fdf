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
import concurrent.futures.thread  # noqa: F401  (registers its exit hook before ours)
import numbers
import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from . import lineage as lineages
from .lineage import Commit, Parent
from .manifest import (
    MANIFEST_NAME,
    IncompleteCheckpointError,
    Manifest,
    UnsupportedFormatError,
    checksum_files,
    package_versions,
    read_manifest,
    scan,
    validate,
    verify_checksums,
    write_manifest,
)
from .retention import incomplete_to_delete
from .storage import Storage, parse_dirname, step_dirname


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says which step, where and why."""


def checked_step(step: object) -> int:
    """``step`` as an ``int`` (a NumPy integer is taken as its int); ``ValueError`` where it
    is not a non-negative integer."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint, as listed by :meth:`~hlat_ckpt.Checkpointer.list`."""

    step: int
    url: str
    time: float
    world_size: int
    lineage: str = ""
    """The run lineage that committed it (:mod:`hlat_ckpt.lineage`; ``""`` before 0.5)."""
    seq: int = 0
    """Its commit number under the root (commit order, whatever the steps)."""
    current: bool = True
    """Whether it is in the current lineage's ancestry: ``False`` for a checkpoint of an
    abandoned lineage, which resume never picks and retention deletes once passed."""


@dataclass(frozen=True)
class SaveStats:
    """What one committed save cost, as seen by the calling process (seconds, bytes).

    ``stall_s`` is how long :meth:`~hlat_ckpt.Checkpointer.save` blocked the caller: for an
    async save the wait for the previous save (``wait_s``), gathering the state dicts and the
    copy to host memory; for a synchronous save everything. ``write_s`` is the writing,
    checksumming (``checksum_s``) and commit, in the background thread for an async save;
    ``save_s`` runs from the call of ``save`` to the commit. ``bytes`` and ``files`` count
    every file of the checkpoint, all ranks' together.

    ``checksums_in_write`` of the ``files`` had their checksum computed while they were
    written (local disks), at no extra read; the others were read back by the commit
    (object stores, files written by another path). ``checksum_s`` is the commit's checksum
    step: that read-back and the exchange of every rank's checksums, close to zero when all
    were computed in the write.
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
    checksums_in_write: int = 0
    rank_bytes: int = 0
    """Tensor bytes this rank staged (async) and handed to the writer: its shards and its
    share of the tensors replicated over ranks, each of which one rank writes."""


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
    name: str = ""
    """The checkpoint's final directory name (``step_<N>``, or ``step_<N>-<lineage>``)."""
    rank_bytes: int = 0
    """Tensor bytes this rank handed to the writer (:attr:`SaveStats.rank_bytes`)."""
    errors: builtins.list[str] = field(default_factory=builtins.list)
    """File-write errors of this rank that the engine did not raise (the commit fails)."""
    checksums: dict[str, tuple[str, int]] = field(default_factory=dict)
    """``{file: (checksum, bytes)}`` that this rank computed while writing its files; the
    commit reads back only the files of its share that have none (or whose byte count is
    not the file's size)."""


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
        if not isinstance(layout, Mapping):
            raise TypeError(f"layout must be a dict, got {type(layout).__name__}")
        _check_json(dict(layout), "layout")
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.save_rng = save_rng
        self.layout = dict(layout)
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
        self._closed = False
        self._saved_steps: set[int] = set()  # committed by this object (storage is checked too)
        self._damaged: set[str] = set()  # directories load_latest skipped for their checksums
        # rank 0's view of the run lineage (hlat_ckpt.lineage), set by a load or the first save
        self._lineage: str | None = None
        self._parent: Parent | None = None
        self._ancestors: tuple[Parent, ...] = ()  # the parents beyond _parent
        # (dirname, lineage) of the commits under the root when start_new_lineage ran
        self._foreign: set[tuple[str, str]] = set()
        self._seq = 0  # the next commit's sequence number
        self._stats_lock = threading.Lock()  # commits may run in an engine's background thread
        self._finished: builtins.list[SaveStats] = []
        self.last_save: SaveStats | None = None
        """What the newest committed save cost (:class:`~hlat_ckpt.SaveStats`)."""
        # Note: at exit concurrent.futures stops taking work (its hook runs before atexit's),
        # and the pending save still needs it (the background write, s3fs's requests); a
        # threading hook registered after that module's import runs before its own
        args = (weakref.ref(self), os.getpid())
        try:
            threading._register_atexit(_wait_at_exit, *args)  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):  # another Python, or already exiting
            atexit.register(_wait_at_exit, *args)

    # --- engine hooks ----------------------------------------------------------------------

    def _finish(self, pending: PendingT) -> None:
        """Complete the pending save ``pending`` up to its commit, or raise
        :class:`CheckpointError`."""
        raise NotImplementedError

    def _resolve(self, state: Mapping[str, Any]) -> Any:
        """Check ``state`` (raising ``TypeError``/``ValueError`` before anything is read)
        and return what :meth:`_read` takes."""
        raise NotImplementedError

    def _read(
        self, step: int, dirname: str, manifest: Manifest, resolved: Any, strict: bool
    ) -> None:
        """Read checkpoint ``step`` from directory ``dirname``, checked against ``manifest``,
        into the state (collective); with ``strict``, refuse a module or optimizer entry
        that holds state no rank's object has."""
        raise NotImplementedError

    def _checksum_share(self, names: builtins.list[str]) -> builtins.list[str]:
        """Which of a checkpoint's files ``names`` this rank checksums; every file is some
        rank's."""
        raise NotImplementedError

    def _check_written(self, sizes: dict[str, int], where: str) -> None:
        """Raise if the files ``sizes`` of a written step are not all the engine wrote."""

    def _check_readable(self, dirname: str, manifest: Manifest) -> None:
        """Raise :class:`IncompleteCheckpointError` if the engine cannot read the committed
        checkpoint ``dirname`` because it is damaged, any other error if it cannot for
        another reason (every rank, after the manifest's checks; :meth:`_check` skips the
        former and raises :class:`CheckpointError` for the latter)."""

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

    @property
    def saving(self) -> bool:
        """Whether a save has been started and not yet committed (an async save in the
        background, or NxD's pending finalize); :meth:`wait` completes it."""
        return self._pending is not None

    def pop_save_stats(self) -> builtins.list[SaveStats]:
        """The :class:`~hlat_ckpt.SaveStats` of the saves committed since the last call,
        oldest first (an async save appears once it has committed)."""
        with self._stats_lock:
            finished, self._finished = self._finished, []
        return finished

    def load_latest(self, state: Mapping[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest complete checkpoint of the current run lineage into ``state``;
        return its step, or ``None`` when there is none (a fresh start).

        The candidates are the newest commit and its ancestry (:mod:`hlat_ckpt.lineage`):
        checkpoints of a lineage abandoned by an earlier resume are never picked, whatever
        their step. Incomplete checkpoints (no manifest, missing or truncated files; an
        engine's own marker alone does not make one complete) and, with
        ``verify_checksums``, damaged ones (a file whose checksum differs from the
        manifest's) are skipped with a warning; resuming from an older checkpoint than the
        newest starts a new lineage. Rank 0 chooses and every rank loads the same step.
        ``strict`` is :meth:`load`'s.
        """
        self._refuse_closed()
        resolved = self._resolve(state)
        self.wait()
        rejected: set[str] = set()
        while True:
            chosen: builtins.list[Any] = [-1, "", ""]
            commits: builtins.list[Commit] = []
            if self.rank == 0:
                manifests, leftovers, chosen[2] = self._scan()
                if not chosen[2] and not manifests and not leftovers:
                    chosen[2] = self._root_mistake()
                if not rejected:
                    self._warn_uncommitted(leftovers)
                # Note: a damaged checkpoint stays among the commits, as an incomplete one
                # does: it is still the head when it was the newest, so resuming from an
                # older one starts a new lineage, and the next commit is numbered after it.
                # Left out, the run would continue its lineage under its number, and a
                # later run, which no longer knows it damaged, would refuse its step.
                commits = [m.commit(d) for d, m in manifests.items()]
                for candidate in lineages.current_ancestry(commits):
                    if candidate.dirname in rejected or candidate.dirname in self._damaged:
                        continue
                    if (candidate.dirname, candidate.lineage) in self._foreign:
                        continue  # another run's: this one started over
                    try:
                        validate(self._storage, candidate.dirname, candidate.step)
                    except IncompleteCheckpointError as e:
                        warnings.warn(f"skipping incomplete checkpoint: {e}", stacklevel=2)
                        rejected.add(candidate.dirname)
                        continue
                    chosen = [candidate.step, candidate.dirname, ""]
                    break
            if self._group is not None:
                dist.broadcast_object_list(chosen, src=self._src, group=self._group)
            step, dirname = int(chosen[0]), str(chosen[1])
            if chosen[2]:
                raise CheckpointError(chosen[2])
            if step < 0:
                if self.rank == 0:
                    self._begin_lineage(commits, None)
                self._saved_steps.clear()
                return None
            manifest, problem = self._check(step, dirname)
            if manifest is not None and problem is None:
                self._read(step, dirname, manifest, resolved, strict)
                if self.rank == 0:
                    self._begin_lineage(commits, manifest.commit(dirname))
                self._saved_steps.clear()
                return step
            if self.rank == 0:
                warnings.warn(f"skipping damaged checkpoint: {problem}", stacklevel=2)
            self._damaged.add(dirname)
            rejected.add(dirname)

    def _scan(self) -> tuple[dict[str, Manifest], dict[str, int], str]:
        """:func:`~hlat_ckpt.manifest.scan` of the root, with why it cannot be used (a
        checkpoint of a newer format) as a third item, ``""`` where it can (rank 0)."""
        try:
            manifests, leftovers = scan(self._storage)
        except UnsupportedFormatError as e:
            return {}, {}, str(e)
        return manifests, leftovers, ""

    def _warn_uncommitted(self, leftovers: dict[str, int]) -> None:
        """Warn about checkpoint directories that were never committed (a save that died
        before its manifest), which resume skips."""
        for dirname, step in sorted(leftovers.items(), key=lambda item: item[1]):
            if parse_dirname(dirname) is None:  # a write directory: in progress or torn
                continue
            try:
                validate(self._storage, dirname, step)
            except IncompleteCheckpointError as e:
                warnings.warn(f"skipping incomplete checkpoint: {e}", stacklevel=3)

    def load(self, step: int, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load checkpoint ``step`` into ``state`` (collective).

        Entries of the checkpoint that ``state`` does not name are ignored, so a model alone
        can be loaded from a full training checkpoint. With ``strict``, a module or
        optimizer entry that holds tensors no rank's object has (a model with fewer layers)
        is refused with :class:`CheckpointError` naming some of them; ranks may hold
        different parameters (pipeline stages), their union counts. ``strict=False`` loads
        what the ranks' objects have and ignores the rest. Per-rank entries need a rank of the
        same number in the saving job. Where two lineages saved ``step``, the current
        lineage's is loaded. Saving after loading a step older than the newest commit starts
        a new lineage (:mod:`hlat_ckpt.lineage`).
        """
        self._refuse_closed()
        step = checked_step(step)
        resolved = self._resolve(state)
        self.wait()
        chosen: builtins.list[Any] = ["", ""]
        commits: builtins.list[Commit] = []
        if self.rank == 0:
            manifests, leftovers, chosen[1] = self._scan()
            if not chosen[1] and not manifests and not leftovers:
                chosen[1] = self._root_mistake()
            commits = [m.commit(d) for d, m in manifests.items()]
            current = {c.dirname for c in lineages.current_ancestry(commits)}
            matches = sorted(
                (c for c in commits if c.step == step),
                key=lambda c: (c.dirname in current, c.order),
            )
            chosen[0] = matches[-1].dirname if matches else ""
        if self._group is not None:
            dist.broadcast_object_list(chosen, src=self._src, group=self._group)
        if chosen[1]:
            raise CheckpointError(chosen[1])
        dirname = str(chosen[0]) or step_dirname(step)
        manifest, problem = self._check(step, dirname)
        if manifest is None or problem is not None:
            raise CheckpointError(f"cannot load step {step}: {problem}")
        self._read(step, dirname, manifest, resolved, strict)
        if self.rank == 0:
            self._begin_lineage(commits, manifest.commit(dirname))
            self._foreign = set()  # an explicit load replaces a start_new_lineage
        self._saved_steps.clear()

    def list(self) -> builtins.list[CheckpointInfo]:
        """The committed checkpoints under the root, in commit order (manifests are read;
        the files are not checked, see :meth:`load_latest`). ``current`` is ``False`` for
        those of abandoned lineages."""
        self._settle()
        manifests, _ = scan(self._storage)
        commits = {d: m.commit(d) for d, m in manifests.items()}
        current = {c.dirname for c in lineages.current_ancestry(commits.values())}
        return [
            CheckpointInfo(
                step=c.step,
                url=self._storage.url_of(c.dirname),
                time=manifests[c.dirname].time,
                world_size=manifests[c.dirname].world_size,
                lineage=c.lineage,
                seq=c.seq,
                current=c.dirname in current,
            )
            for c in sorted(commits.values(), key=lambda c: c.order)
        ]

    def start_new_lineage(self) -> None:
        """Commit the next saves under a new lineage without a parent: for a run that starts
        over, not resumed, under a root that holds another run's checkpoints. Those become
        an abandoned lineage (:mod:`hlat_ckpt.lineage`): this object's :meth:`load_latest`
        never picks them (before this run's first commit it finds nothing), other
        checkpointers do not once this run has committed, and retention deletes each once
        this run has committed a step at least as new (``keep_last=None``: never). Without
        it, the first save of a checkpointer that loaded nothing continues the newest
        commit's lineage, as if resumed from it. Call it on every rank, before the first
        save. An explicit :meth:`load` of a step undoes it: the run then forks from that
        step, as without it."""
        self._refuse_closed()
        self.wait()
        if self.rank == 0:
            manifests, _ = scan(self._storage)
            if manifests:  # else the first save starts a lineage of its own anyway
                commits = [m.commit(d) for d, m in manifests.items()]
                self._foreign = {(c.dirname, c.lineage) for c in commits}
                self._begin_lineage(commits, None)
        self._saved_steps.clear()

    @property
    def lineage(self) -> str | None:
        """The lineage id this checkpointer commits under (rank 0; ``None`` before its first
        load or save)."""
        return self._lineage

    def close(self) -> None:
        """Wait for the last save to commit. A closed checkpointer (also at the end of a
        ``with`` block) refuses to save or load: create a new one for that."""
        self._closed = True
        self.wait()

    def _refuse_closed(self) -> None:
        if self._closed:
            raise CheckpointError(
                f"this {type(self).__name__} of {self.url} is closed; create a new one to save "
                "or load"
            )

    def _root_mistake(self) -> str:
        """Why the root cannot hold checkpoints, where it is a file or a checkpoint directory
        passed by mistake, else ``""`` (rank 0, where no checkpoint was found under it)."""
        storage = self._storage
        if storage.fs.isfile(storage.root):
            return f"{self.url} is a file, not a directory of checkpoints"
        for name in (*self._markers, ".metadata"):
            if storage.exists(name):
                parent = self.url.rsplit("/", 1)[0] if "/" in self.url else "."
                return (
                    f"{self.url} is a checkpoint (it holds {name}), not a directory of "
                    f"checkpoints; pass its parent ({parent})"
                )
        return ""

    def __enter__(self: PolicyT) -> PolicyT:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()
            return
        # Note: the block is already raising; a failed background save must not replace
        # that error (it is the cause the user needs), so it is reported as a warning
        try:
            self.close()
        except Exception as e:
            warnings.warn(
                f"{type(self).__name__}.close() while leaving the with block on "
                f"{type(exc).__name__}: {type(e).__name__}: {e}",
                stacklevel=2,
            )

    # --- resume ----------------------------------------------------------------------------

    def _check(self, step: int, dirname: str) -> tuple[Manifest | None, str | None]:
        """``(manifest, None)`` when checkpoint ``step`` is complete and, with
        ``verify_checksums``, undamaged; ``(manifest or None, what is wrong)`` otherwise.

        Collective: every rank checks the sizes, reads back its share of the files (see
        :meth:`_checksum_share`) and runs the engine's :meth:`_check_readable`, and all ranks
        get the same answer. A read error other than a mismatch raises
        :class:`CheckpointError` on every rank (the checkpoint may be fine).
        """
        manifest: Manifest | None = None
        outcome: tuple[str, str] | None = None
        try:
            manifest = validate(self._storage, dirname, step)
            if self.verify_checksums:
                mine = self._checksum_share(builtins.list(manifest.checksums))
                verify_checksums(self._storage, dirname, manifest, mine)
            self._check_readable(dirname, manifest)
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

    def _begin_lineage(self, commits: builtins.list[Commit], resumed: Commit | None) -> None:
        """Decide the lineage this checkpointer commits under, after resuming from
        ``resumed`` (``None``: nothing was loaded) among ``commits`` (rank 0).

        Resuming from the newest commit continues its lineage; from any other (an older
        step, or the newest failed its checks), or from nothing, starts a new one whose
        parent is the checkpoint resumed from. A legacy head (no lineage recorded) is
        continued under a new id whose parent is that head.
        """
        tip = lineages.head(commits)
        # the chain of parents, recorded whole in every manifest: read while the commits that
        # record it exist, it outlives their deletion by retention
        chain: tuple[Parent, ...] = ()
        if resumed is not None and tip is not None and resumed.dirname == tip.dirname:
            if tip.lineage != lineages.LEGACY_LINEAGE:
                self._lineage, chain = tip.lineage, lineages.parents(commits, tip)
            else:
                self._lineage, chain = lineages.new_lineage_id(), (tip.as_parent(),)
        else:
            self._lineage = lineages.new_lineage_id()
            if resumed is not None:
                chain = (resumed.as_parent(), *lineages.parents(commits, resumed))
        self._parent, self._ancestors = (chain[0], chain[1:]) if chain else (None, ())
        self._seq = lineages.next_seq(commits)

    def _ensure_lineage(self) -> str:
        """Before the first save of a checkpointer that loaded nothing (rank 0): continue the
        newest commit's lineage, as if resumed from it. Returns why the root cannot hold
        checkpoints (:meth:`_root_mistake`), or ``""``."""
        if self._lineage is not None:
            return ""
        manifests, leftovers = scan(self._storage)
        if not manifests and not leftovers and (mistake := self._root_mistake()):
            return mistake
        commits = [m.commit(d) for d, m in manifests.items()]
        self._begin_lineage(commits, lineages.head(commits))
        return ""

    def _prepare(self, step: int) -> str:
        """Refuse a step already committed in this run's lineage; choose the directory name
        of ``step`` and clear leftovers of an interrupted save into it (rank 0, before
        anyone writes). Returns the name on every rank. Collective.

        The name is ``step_<N>``, or ``step_<N>-<lineage>`` when an abandoned lineage
        committed ``step_<N>`` (it is kept until this lineage gets past it).
        """
        name, refusal = step_dirname(step), ""
        if self.rank == 0:
            try:
                refusal = self._ensure_lineage()
                if not refusal:
                    name, refusal = self._choose_dirname(step)
            except UnsupportedFormatError as e:
                refusal = f"step {step} not saved: {e}"
            if not refusal:
                self._storage.remove_dir(self._storage.write_dirname(name))
        steps = [step]
        if self._group is not None:
            mine = torch.tensor([step], dtype=torch.int64)
            gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine, group=self._group)
            steps = [int(t[0]) for t in gathered]
            decision: builtins.list[Any] = [name, refusal]
            dist.broadcast_object_list(decision, src=self._src, group=self._group)
            name, refusal = decision
        if len(set(steps)) != 1:
            raise CheckpointError(f"ranks called save() with different steps: {steps}")
        if refusal:
            raise CheckpointError(refusal)
        return name

    def _choose_dirname(self, step: int) -> tuple[str, str]:
        """``(directory name, "")`` for a new checkpoint of ``step``, or ``("", why not)``
        (rank 0)."""
        assert self._lineage is not None
        free: builtins.list[str] = []
        for name in (step_dirname(step), step_dirname(step, self._lineage)):
            if not self._storage.exists(name):
                free.append(name)
                continue
            try:
                # Note: a damaged checkpoint (a file cut short, or one whose checksum no
                # longer matches) was skipped by load_latest, so the resumed run reaches
                # this step again: replace it (keep_last=None deletes no checkpoint: one
                # with a manifest is then an abandoned lineage's, saved beside)
                if name in self._damaged and self.keep_last is not None:
                    raise IncompleteCheckpointError(f"{name} failed its checksums")
                manifest = validate(self._storage, name, step)
            except IncompleteCheckpointError as error:
                kept = self._kept_manifest(name, step)
                problem = f" but is incomplete ({error})"
                if kept is None:
                    # Note: the engine's files and markers (NxD's done) would otherwise
                    # survive into the new save, and a stale marker would mark it finished
                    # too early.
                    self._storage.remove_dir(name)
                    self._damaged.discard(name)
                    free.append(name)
                    continue
                manifest = kept
            else:
                problem = ""
            if self._in_ancestry(manifest.commit(name)):
                return "", (
                    f"a checkpoint of step {step} already exists at "
                    f"{self._storage.url_of(name)}{problem}; save each step once (delete it "
                    "to save it again)"
                )
            # otherwise an abandoned lineage's, kept until this lineage gets past it
        if free:
            return free[0], ""
        return "", f"step {step} has checkpoints of two other lineages; delete one to save it"

    def _kept_manifest(self, name: str, step: int) -> Manifest | None:
        """Under ``keep_last=None``, which deletes no checkpoint, the manifest of the
        incomplete or damaged checkpoint ``name`` of ``step`` (committed, then a file cut
        short or changed); ``None`` otherwise, and for a directory without a manifest of
        ``step`` (a save that died before its commit)."""
        if self.keep_last is not None:
            return None
        try:
            manifest = read_manifest(self._storage, name)
        except IncompleteCheckpointError:
            return None
        return manifest if manifest.step == step else None

    def _in_ancestry(self, other: Commit) -> bool:
        """Whether ``other`` is one of this run's own commits or ancestors (rank 0)."""
        assert self._lineage is not None
        if other.lineage == self._lineage:
            return True
        manifests, _ = scan(self._storage)
        tip = Commit(-1, "", self._lineage, self._seq, self._parent, self._ancestors)
        commits = [*(m.commit(d) for d, m in manifests.items()), tip]
        return other.dirname in {c.dirname for c in lineages.ancestry(commits, tip)}

    def _commit(self, dirname: str, written: Written) -> None:
        """Checksum the files every rank wrote into ``dirname`` for ``written.step``, write
        the manifest (the commit), make the directory final, apply retention and record the
        :class:`SaveStats`. Collective; once every rank's files are written.

        Rank 0 lists the files and their sizes and sends them to every rank; each rank
        answers, in one gather to rank 0, with the checksums it computed while writing
        (``written.checksums``) and a read-back of the files of its share
        (:meth:`_checksum_share`) that have none.
        """
        step = written.step
        final = written.name or step_dirname(step)
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
        listed: builtins.list[Any] = [sizes if error is None else None]
        if self._group is not None:
            dist.broadcast_object_list(listed, src=self._src, group=self._group)
        sums: dict[str, str] = {}
        in_write: builtins.list[str] = []
        problem: str | None = None
        if written.errors:
            problem = f"rank {self.rank} could not write its files: {'; '.join(written.errors)}"
        elif listed[0] is not None:
            try:
                sums, in_write = self._share_checksums(dirname, listed[0], written.checksums)
            except Exception as e:
                problem = f"rank {self.rank} could not checksum its files: {type(e).__name__}: {e}"
        gathered: builtins.list[Any] = [(sums, in_write, problem)]
        if self._group is not None:
            gathered = [None] * self.world_size if self.rank == 0 else []
            dist.gather_object(
                (sums, in_write, problem),
                gathered if self.rank == 0 else None,
                dst=self._src,
                group=self._group,
            )
        checksum_s = time.perf_counter() - checksum_start
        total = [0, 0, 0]
        if self.rank == 0 and error is None:
            try:
                problems = [p for _, _, p in gathered if p]
                if problems:
                    raise CheckpointError("; ".join(problems))
                checksums: dict[str, str] = {}
                for part, _, _ in gathered:
                    for name, value in part.items():
                        if checksums.setdefault(name, value) != value:
                            raise CheckpointError(
                                f"ranks disagree on the checksum of {name}: "
                                f"{checksums[name]} and {value}"
                            )
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
                    lineage=lineages.lineage_record(
                        self._lineage or "", self._seq, self._parent, self._ancestors
                    ),
                )
                write_manifest(self._storage, dirname, manifest)
                self._storage.commit_dir(dirname, final)
                from_write = {name for _, names, _ in gathered for name in names}
                total = [manifest.total_bytes, len(manifest.files), len(from_write)]
            except BaseException as e:
                error = e
        if error is not None:
            self._abandon(dirname)
        failed = error is not None
        if self._group is not None:
            flag = torch.tensor([int(failed), *total], dtype=torch.int64)
            dist.broadcast(flag, src=self._src, group=self._group)
            failed = bool(flag[0].item())
            total = [int(t) for t in flag[1:].tolist()]
        if failed:
            detail = f"{type(error).__name__}: {error}" if error is not None else "see rank 0"
            raise CheckpointError(
                f"committing step {step} to {where} failed: {detail}; {self._after_failed_commit}"
            ) from error
        if self.rank == 0:
            self._damaged.discard(final)
            self._seq += 1
            self._retain(
                Commit(
                    step, final, self._lineage or "", self._seq - 1, self._parent, self._ancestors
                )
            )
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
            checksums_in_write=total[2],
            rank_bytes=written.rank_bytes,
        )
        with self._stats_lock:
            self._finished.append(stats)
            self.last_save = stats
            self._saved_steps.add(step)

    def _share_checksums(
        self, dirname: str, sizes: dict[str, int], in_write: dict[str, tuple[str, int]]
    ) -> tuple[dict[str, str], builtins.list[str]]:
        """``({file: checksum}, [files checksummed in the write])``: this rank's part of the
        manifest's checksums. The checksums ``in_write`` that this rank computed while
        writing count where they covered the whole file (their byte count is its size in
        ``sizes``); the files of this rank's share without one are read back."""
        sums = {name: crc for name, (crc, nbytes) in in_write.items() if sizes.get(name) == nbytes}
        from_write = sorted(sums)
        rest = [name for name in self._checksum_share(sorted(sizes)) if name not in sums]
        sums.update(checksum_files(self._storage, dirname, rest))
        return sums, from_write

    # --- retention -------------------------------------------------------------------------

    def _retain(self, committed: Commit) -> None:
        """Delete what keep_last/keep_every no longer keep, abandoned lineages' checkpoints
        this lineage has got past, and leftovers of other saves, just after ``committed``
        was committed (rank 0; the rule is :func:`hlat_ckpt.lineage.to_delete`). Deletes
        nothing where the root now holds a checkpoint of a newer format (a newer release
        saving there too), with a warning."""
        try:
            manifests, leftovers = scan(self._storage)
        except UnsupportedFormatError as e:
            warnings.warn(f"retention skipped after step {committed.step}: {e}", stacklevel=2)
            return
        commits: builtins.list[Commit] = []
        for dirname, manifest in manifests.items():
            damaged = dirname in self._damaged and dirname != committed.dirname
            if damaged and self.keep_last is not None:
                # skipped by load_latest: not one to keep (keep_last=None deletes no checkpoint)
                leftovers[dirname] = manifest.step
            else:
                commits.append(manifest.commit(dirname))
        if committed.dirname not in manifests:  # listing lags on some object stores
            commits.append(committed)
        doomed = [
            c.dirname
            for c in lineages.to_delete(commits, committed, self.keep_last, self.keep_every)
        ]
        by_step: dict[int, builtins.list[str]] = {}
        for dirname, step in leftovers.items():
            if dirname != self._storage.write_dirname(committed.dirname):
                by_step.setdefault(step, []).append(dirname)
        for step in incomplete_to_delete(by_step, committed.step):
            doomed += by_step[step]
        if doomed:
            self._delete(doomed)

    def _settle(self) -> None:
        """Finish deletions an engine runs in the background (before listing the root)."""

    def _delete(self, doomed: builtins.list[str]) -> None:
        """Delete the checkpoint directories ``doomed`` (rank 0, after a commit); an engine
        may do it in the background, as long as :meth:`wait` waits for it."""
        for dirname in doomed:
            try:
                # Markers first: a deletion cut short leaves an incomplete checkpoint that
                # neither resume nor the engine takes for complete, never one that looks
                # complete but lacks files.
                for marker in self._markers:
                    self._storage.remove_file(dirname, marker)
                self._storage.remove_dir(dirname)
                self._damaged.discard(dirname)
            except Exception as e:
                warnings.warn(
                    f"retention could not delete {self._storage.url_of(dirname)}: {e}",
                    stacklevel=2,
                )


def _check_json(value: Any, where: str) -> None:
    """Raise ``ValueError`` where ``value`` is not what JSON records as it is: dicts with
    str keys, lists and tuples, str, int, float, bool and None."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(
                    f"{where} has the key {key!r} ({type(key).__name__}); it is recorded as "
                    "JSON, whose keys are str"
                )
            _check_json(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
    elif value is not None and not isinstance(value, str | int | float):
        raise ValueError(
            f"{where} is {value!r} ({type(value).__name__}); it is recorded as JSON: use "
            "str, int, float, bool, None, lists and dicts with str keys"
        )


def _wait_at_exit(ref: weakref.ref[CheckpointPolicy[Any]], pid: int) -> None:
    # a forked child (a DataLoader worker) inherits the hook, not the thread that writes
    checkpointer = ref()
    if checkpointer is None or os.getpid() != pid:
        return
    try:
        checkpointer.wait()
    except Exception:
        traceback.print_exc()
        print("hlat-ckpt: the last checkpoint was not committed (see above)", file=sys.stderr)
