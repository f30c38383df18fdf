"""The checkpoint interface of :class:`~hlat_ckpt.Checkpointer` on AWS Trainium (trn1),
writing the model and optimizer shards through NeuronX Distributed (NxD).

Written against neuronx-distributed 0.18.0 (Neuron SDK 2.29, aws-neuron/neuronx-distributed
at fbac349b61a3adbb123c2983835af692840ff62f): ``save_checkpoint``, ``load_checkpoint`` and
``finalize_checkpoint``. NxD writes each rank's model and optimizer shards (one file per
TP rank and, for ZeRO-1, per DP rank: NxD's parallel layers hold plain per-rank tensors,
which ``torch.distributed.checkpoint`` would save as one replicated copy), the scheduler and
``user_content`` from rank 0, and a ``done`` file. Around that, this module keeps hlat-ckpt's
semantics:

- a checkpoint is complete only once ``hlat-checkpoint.json`` (the manifest of
  :mod:`hlat_ckpt.manifest`, with every file's size and CRC-32) is written, after NxD's
  ``done``; resume picks the newest complete one and, with ``verify_checksums``, skips a
  damaged one for the one before;
- per-rank state (data loader, counters, RNG) is saved by every rank, in
  ``hlat-rank/rank_<rank>.pt`` (NxD's ``user_content`` is rank 0's only);
- retention (keep the last N) is done here after each commit, never by NxD
  (``num_kept_ckpts=None``), and never removes anything when a save fails.

The argument mapping and the bookkeeping are tested without NxD; the calls into NxD are
unverified on hardware (they need a trn1 instance with the Neuron SDK). Trust model: NxD
saves its files with ``torch.save`` and loads them with pickle; load only checkpoints you
trust. The per-rank files hold JSON and tensors, loaded with ``weights_only=True``.
"""

from __future__ import annotations

import atexit
import builtins
import io
import os
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import state_json
from .checkpointer import CheckpointError, CheckpointInfo, SaveStats
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

STEP_KEY = "hlat_step"
"""The step, in NxD's ``user_content``."""
DONE = "done"
"""NxD's marker of a checkpoint it finished writing."""
RANK_DIR = "hlat-rank"
"""Where each rank's own state goes inside a checkpoint."""
RNG_ENTRY = "rng"
_RANK_FORMAT = "hlat-rank-state"


def rank_file(rank: int) -> str:
    """The per-rank state file of ``rank``, relative to the checkpoint directory."""
    return f"{RANK_DIR}/rank_{rank:05d}.pt"


def split_state(state: Mapping[str, Any]) -> tuple[nn.Module, Any, Any, dict[str, Any]]:
    """``(model, optimizer, scheduler, others)`` of a state mapping for NxD.

    NxD saves exactly one model, at most one optimizer and one scheduler itself; every other
    entry (data loader, counters, RNG) is saved per rank by :class:`NeuronCheckpointer`.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must map names to objects, got {type(state).__name__}")
    models = [n for n, o in state.items() if isinstance(o, nn.Module)]
    optimizers = [n for n, o in state.items() if isinstance(o, torch.optim.Optimizer)]
    schedulers = [
        n for n, o in state.items() if isinstance(o, torch.optim.lr_scheduler.LRScheduler)
    ]
    if len(models) != 1:
        raise ValueError(f"the Neuron backend saves exactly one nn.Module; state has {models}")
    if len(optimizers) > 1 or len(schedulers) > 1:
        raise ValueError(
            f"the Neuron backend saves at most one optimizer and one scheduler; state has "
            f"optimizers {optimizers} and schedulers {schedulers}"
        )
    taken = {*models, *optimizers, *schedulers}
    others = {n: o for n, o in state.items() if n not in taken}
    for name, obj in others.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("_"):
            raise ValueError(
                f"state name {name!r}: use a non-empty str without '/' that does not start with '_'"
            )
        if not (callable(getattr(obj, "state_dict", None)) or isinstance(obj, dict)):
            raise TypeError(
                f"state[{name!r}] is a {type(obj).__name__}: pass an object with "
                "state_dict()/load_state_dict() or a dict"
            )
    return (
        state[models[0]],
        state[optimizers[0]] if optimizers else None,
        state[schedulers[0]] if schedulers else None,
        others,
    )


def manifest_entries(state: Mapping[str, Any], save_rng: bool = True) -> dict[str, str]:
    """How each entry of ``state`` is saved, as the manifest records it: ``nxd-model``,
    ``nxd-optimizer``, ``nxd-scheduler`` (NxD's files), ``rank`` or ``dict`` (per rank)."""
    model, optimizer, scheduler, others = split_state(state)
    entries: dict[str, str] = {}
    for name, obj in state.items():
        if obj is model:
            entries[name] = "nxd-model"
        elif obj is optimizer:
            entries[name] = "nxd-optimizer"
        elif obj is scheduler:
            entries[name] = "nxd-scheduler"
        else:
            entries[name] = "dict" if isinstance(obj, dict) else "rank"
    if save_rng and RNG_ENTRY not in others:
        entries[RNG_ENTRY] = "rank"
    return entries


def save_checkpoint_kwargs(
    root: str,
    step: int,
    state: Mapping[str, Any],
    *,
    async_save: bool = True,
    use_xser: bool = True,
    num_workers: int = 8,
) -> dict[str, Any]:
    """Keyword arguments of ``neuronx_distributed.save_checkpoint`` for ``state``.

    Note: ``num_kept_ckpts`` is ``None``: NxD would count the checkpoints it marked
    ``done``, including ones hlat-ckpt never committed or found damaged, and delete the
    oldest; retention is :class:`NeuronCheckpointer`'s, after its commit.
    """
    model, optimizer, scheduler, _ = split_state(state)
    return {
        "checkpoint_dir_str": root,
        "tag": step_dirname(step),
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "user_content": {STEP_KEY: step},
        "num_workers": num_workers,
        "use_xser": use_xser,
        "num_kept_ckpts": None,
        "async_save": async_save,
    }


def load_checkpoint_kwargs(
    root: str, step: int, state: Mapping[str, Any], *, num_workers: int = 8
) -> dict[str, Any]:
    """Keyword arguments of ``neuronx_distributed.load_checkpoint`` for step ``step``.

    Note: the tag is always given: without one NxD takes the newest tag with a ``done``
    file (by modification time), which may be one hlat-ckpt has not committed or has found
    damaged.
    """
    model, optimizer, scheduler, _ = split_state(state)
    return {
        "path": root,
        "tag": step_dirname(step),
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "num_workers": num_workers,
        "strict": True,
    }


def rank_state_bytes(others: Mapping[str, Any], save_rng: bool = True) -> bytes:
    """This rank's non-NxD entries (and its RNG states) as the bytes of its per-rank file:
    a ``torch.save`` of JSON and CPU tensors, readable with ``weights_only=True``."""
    values: dict[str, Any] = {}
    for name, obj in others.items():
        values[name] = dict(obj) if isinstance(obj, dict) else obj.state_dict()
    if save_rng and RNG_ENTRY not in others:
        values[RNG_ENTRY] = RNGState().state_dict()
    skeleton, tensors = state_json.split(values, RANK_DIR)
    record = {
        "format": _RANK_FORMAT,
        "json": state_json.dumps(skeleton),
        "tensors": {k: t.detach().cpu() for k, t in tensors.items()},
    }
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


def restore_rank_state(data: bytes, others: Mapping[str, Any], where: str = "rank state") -> None:
    """Load the per-rank file ``data`` into the entries ``others`` (and the RNG states, when
    the file has them and ``others`` has no ``rng`` entry of its own)."""
    record = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    if not isinstance(record, dict) or record.get("format") != _RANK_FORMAT:
        raise CheckpointError(f"{where} is not an hlat-ckpt per-rank state file")
    values = state_json.join(state_json.loads(record["json"]), record["tensors"], where)
    for name, obj in others.items():
        if name not in values:
            raise CheckpointError(
                f"{where} has no entry {name!r} (it has {sorted(values)}); remove it from the "
                "state to load the others"
            )
        if isinstance(obj, dict):
            obj.clear()
            obj.update(values[name])
        else:
            obj.load_state_dict(values[name])
    if RNG_ENTRY in values and RNG_ENTRY not in others:
        RNGState().load_state_dict(values[RNG_ENTRY])


def checksum_share(names: builtins.list[str], rank: int, world_size: int) -> builtins.list[str]:
    """The files of a checkpoint that ``rank`` checksums: every ``world_size``-th of the
    sorted names, so the reading is spread over the ranks whatever wrote which file."""
    return [n for i, n in enumerate(sorted(names)) if i % world_size == rank]


@dataclass
class _Pending:
    """A save NxD has written (or is writing) that is not committed yet."""

    step: int
    entries: dict[str, str]
    started: float
    stall_s: float
    """How long save() blocked; negative for a synchronous save (it blocked throughout)."""
    wait_s: float
    write_start: float


class NeuronCheckpointer:
    """:class:`~hlat_ckpt.Checkpointer`'s interface and guarantees on Trainium, with NxD
    writing the model and optimizer shards.

    Args:
        root_url: a local or shared path, or ``s3://`` URL, holding ``step_<N>/`` folders
            (what NxD's checkpoint storage accepts).
        keep_last: how many of the newest complete checkpoints to keep (``None``: all).
        keep_every: also keep, permanently, every step that is a multiple of this.
        async_save: NxD's asynchronous save: :meth:`save` returns once the shards are
            copied to host memory. As NxD marks such a save ``done`` only when the next save
            begins (or at :meth:`wait`), it is committed then too.
        storage_options: fsspec options for ``root_url``, for the bookkeeping here (NxD
            reads and writes S3 with its own client and credentials).
        save_rng: save and restore each rank's Python/NumPy/torch RNG states as ``"rng"``.
        process_group: the ranks that checkpoint together; by default all ranks, through a
            new gloo group of their own.
        layout: free-form description of the parallel layout, recorded in the manifest.
        verify_checksums: before loading, read every file back and compare it with the
            manifest's checksum (the ranks share the reading); a damaged checkpoint is
            skipped by :meth:`load_latest` and refused by :meth:`load`.
        use_xser: NxD's tensor-per-file serialisation (faster; NxD's default off).
        num_workers: NxD's number of ranks per node writing or reading at once.
        nxd: the module providing ``save_checkpoint``, ``load_checkpoint`` and
            ``finalize_checkpoint``; default ``neuronx_distributed``, imported here.

    ``state`` maps names to one ``nn.Module`` (built with NxD's parallel layers), at most one
    optimizer (NxD's ``NeuronZero1Optimizer``) and one LR scheduler, which NxD saves, and
    any other objects with ``state_dict()/load_state_dict()`` or plain dicts, saved per rank.

    Note: construct it on every rank in the same order (it creates a process group) and
    call :meth:`close` (or :meth:`wait`) before the process group is destroyed.
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
        verify_checksums: bool = True,
        use_xser: bool = True,
        num_workers: int = 8,
        nxd: Any = None,
    ):
        if not isinstance(root_url, str | os.PathLike) or not os.fspath(root_url):
            raise TypeError(f"root_url must be a non-empty path or URL, got {root_url!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise ValueError(f"keep_every must be an int >= 1 or None, got {keep_every!r}")
        if nxd is None:
            try:
                import neuronx_distributed

                nxd = neuronx_distributed
            except Exception as e:  # the PyPI placeholder raises on import, not ImportError
                raise RuntimeError(
                    "NeuronCheckpointer needs neuronx-distributed and torch-neuronx from the "
                    "Neuron package repository (on a trn1 instance); use Checkpointer "
                    f"elsewhere ({type(e).__name__}: {e})"
                ) from e
        self._nxd = nxd
        self._storage = Storage(root_url, storage_options)
        self.root = os.fspath(root_url)
        self.url = self._storage.url
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.save_rng = save_rng
        self.layout = {"backend": "nxd", **(layout or {})}
        self.verify_checksums = verify_checksums
        self.use_xser = use_xser
        self.num_workers = num_workers
        if dist.is_available() and dist.is_initialized():
            # Note: gloo, not the default (XLA) group: the bookkeeping exchanges host values
            # and must not enter the device's traced graph.
            self._group: dist.ProcessGroup | None = process_group or dist.new_group(backend="gloo")
            self.rank = dist.get_rank(self._group)
            self.world_size = dist.get_world_size(self._group)
            self._src = dist.get_global_rank(self._group, 0)
        else:
            self._group = None
            self.rank, self.world_size, self._src = 0, 1, 0
        self._pending: _Pending | None = None
        self._saved_steps: set[int] = set()
        self._damaged: set[int] = set()
        self._finished: builtins.list[SaveStats] = []
        self.last_save: SaveStats | None = None
        """What the newest committed save cost (:class:`~hlat_ckpt.SaveStats`)."""
        atexit.register(_wait_at_exit, weakref.ref(self))

    # --- public API ------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint ``state`` as step ``step`` (collective: every rank calls it).

        Commits the previous asynchronous save first (raising its error, if it failed).
        With ``async_save`` this returns once NxD has copied the shards to host memory;
        the checkpoint is committed by the next :meth:`save`, :meth:`wait` or :meth:`close`.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        started = time.perf_counter()
        _, _, _, others = split_state(state)
        entries = manifest_entries(state, self.save_rng)
        self.wait()
        wait_s = time.perf_counter() - started
        if step in self._saved_steps:
            raise CheckpointError(
                f"a checkpoint of step {step} already exists at "
                f"{self._storage.url_of(step_dirname(step))}; save each step once"
            )
        self._prepare(step)
        dirname = step_dirname(step)
        where = self._storage.url_of(dirname)
        write_start = time.perf_counter()
        try:
            data = rank_state_bytes(others, self.save_rng)
            self._storage.makedirs(dirname, RANK_DIR)
            with self._storage.fs.open(
                self._storage.path(dirname, rank_file(self.rank)), "wb"
            ) as f:
                f.write(data)
            self._nxd.save_checkpoint(
                **save_checkpoint_kwargs(
                    self.root,
                    step,
                    state,
                    async_save=self.async_save,
                    use_xser=self.use_xser,
                    num_workers=self.num_workers,
                )
            )
        except BaseException as e:
            raise CheckpointError(
                f"saving step {step} to {where} failed: {type(e).__name__}: {e}; earlier "
                "checkpoints are untouched"
            ) from e
        if self.async_save:
            stall_s = time.perf_counter() - started
            self._pending = _Pending(step, entries, started, stall_s, wait_s, write_start)
        else:
            self._commit(_Pending(step, entries, started, -1.0, wait_s, write_start))

    def wait(self) -> None:
        """Finish the pending asynchronous save (NxD's ``finalize_checkpoint``) and commit
        it; raise :class:`~hlat_ckpt.CheckpointError` if it failed. A no-op when none is
        pending (collective when one is)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.write_start = time.perf_counter()
        try:
            self._nxd.finalize_checkpoint()
        except BaseException as e:
            raise CheckpointError(
                f"saving step {pending.step} to {self.url} failed in the background: "
                f"{type(e).__name__}: {e}; earlier checkpoints are untouched"
            ) from e
        self._commit(pending)

    def load_latest(self, state: Mapping[str, Any]) -> int | None:
        """Load the newest complete checkpoint into ``state``; return its step, or ``None``
        when there is none (a fresh start).

        Incomplete checkpoints (no manifest, a missing or truncated file; NxD's ``done``
        alone does not make one complete) and, with ``verify_checksums``, damaged ones are
        skipped with a warning. Rank 0 chooses and every rank loads the same step.
        """
        split_state(state)
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
                self._read(step, manifest, state)
                return step
            if self.rank == 0:
                warnings.warn(f"skipping damaged checkpoint: {problem}", stacklevel=2)
            self._damaged.add(step)
            rejected.add(step)

    def load(self, step: int, state: Mapping[str, Any]) -> None:
        """Load checkpoint ``step`` into ``state`` (collective)."""
        split_state(state)
        self.wait()
        manifest, problem = self._check(step)
        if manifest is None or problem is not None:
            raise CheckpointError(f"cannot load step {step}: {problem}")
        self._read(step, manifest, state)

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

    def pop_save_stats(self) -> builtins.list[SaveStats]:
        """The :class:`~hlat_ckpt.SaveStats` of the saves committed since the last call,
        oldest first.

        For an asynchronous save, ``stall_s`` is the time :meth:`save` blocked (NxD's copy
        to host memory, after ``wait_s`` committing the previous save), ``write_s`` the time
        the commit blocked (waiting for NxD's writes, checksumming, the manifest) and
        ``save_s`` runs from the call of :meth:`save` to the commit, training in between.
        """
        finished, self._finished = self._finished, []
        return finished

    def close(self) -> None:
        """Commit the last save."""
        self.wait()

    def __enter__(self) -> NeuronCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------

    def _prepare(self, step: int) -> None:
        """Refuse a step already committed; clear leftovers of an interrupted save of it
        (rank 0, before anyone writes). Collective."""
        exists = 0
        if self.rank == 0:
            final, tmp = self._storage.list_steps()
            if step in final:
                try:
                    # Note: a damaged checkpoint was skipped by load_latest, so the resumed
                    # run reaches this step again: replace it.
                    if step in self._damaged:
                        raise DamagedCheckpointError(f"step {step} failed its checksums")
                    validate(self._storage, final[step], step)
                    exists = 1
                except IncompleteCheckpointError:
                    # Note: NxD's files and its done marker would otherwise survive into the
                    # new save, and a stale done would mark it finished too early.
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

    def _commit(self, pending: _Pending) -> None:
        """Checksum the files NxD and the ranks wrote for ``pending.step``, write the
        manifest (the commit) and apply retention. Collective."""
        step = pending.step
        dirname = step_dirname(step)
        where = self._storage.url_of(dirname)
        error: BaseException | None = None
        sizes: dict[str, int] = {}
        if self.rank == 0:
            try:
                sizes = self._storage.file_sizes(dirname)
                if DONE not in sizes:
                    raise CheckpointError(f"NxD did not mark {where} {DONE}")
            except BaseException as e:
                error = e
        names: builtins.list[Any] = [sorted(sizes) if error is None else None]
        if self._group is not None:
            dist.broadcast_object_list(names, src=self._src, group=self._group)
        checksum_start = time.perf_counter()
        sums: dict[str, str] = {}
        problem: str | None = None
        if names[0] is not None:
            try:
                mine = checksum_share(names[0], self.rank, self.world_size)
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
                    entries=pending.entries,
                    files=sizes,
                    layout=self.layout,
                    versions=package_versions(),
                    checksums=checksums,
                )
                write_manifest(self._storage, dirname, manifest)
                total = [manifest.total_bytes, len(manifest.files)]
            except BaseException as e:
                error = e
        failed = error is not None
        if self._group is not None:
            flag = torch.tensor([int(failed), *total], dtype=torch.int64)
            dist.broadcast(flag, src=self._src, group=self._group)
            failed = bool(flag[0].item())
            total = [int(flag[1].item()), int(flag[2].item())]
        if failed:
            detail = f"{type(error).__name__}: {error}" if error is not None else "see rank 0"
            raise CheckpointError(
                f"committing step {step} to {where} failed: {detail}; it stays uncommitted "
                "(resume skips it) and earlier checkpoints are untouched"
            ) from error
        if self.rank == 0:
            self._damaged.discard(step)
            self._retain(step)
        end = time.perf_counter()
        synchronous = pending.stall_s < 0
        stats = SaveStats(
            step=step,
            async_save=not synchronous,
            stall_s=end - pending.started if synchronous else pending.stall_s,
            wait_s=pending.wait_s,
            write_s=end - pending.write_start,
            checksum_s=checksum_s,
            save_s=end - pending.started,
            bytes=total[0],
            files=total[1],
        )
        self._finished.append(stats)
        self.last_save = stats
        self._saved_steps.add(step)

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
                # Manifest first, then NxD's marker: a deletion cut short leaves a checkpoint
                # that neither hlat-ckpt nor NxD takes for complete.
                self._storage.remove_file(dirname, MANIFEST_NAME)
                self._storage.remove_file(dirname, DONE)
                self._storage.remove_dir(dirname)
            except Exception as e:
                warnings.warn(
                    f"retention could not delete {self._storage.url_of(dirname)}: {e}",
                    stacklevel=2,
                )

    def _check(self, step: int) -> tuple[Manifest | None, str | None]:
        """``(manifest, None)`` when checkpoint ``step`` is complete and, with
        ``verify_checksums``, undamaged; ``(manifest or None, what is wrong)`` otherwise.
        Collective: every rank checks the sizes and reads back its share of the files."""
        dirname = step_dirname(step)
        manifest: Manifest | None = None
        outcome: tuple[str, str] | None = None
        try:
            manifest = validate(self._storage, dirname, step)
            if self.verify_checksums:
                mine = checksum_share(builtins.list(manifest.checksums), self.rank, self.world_size)
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

    def _read(self, step: int, manifest: Manifest, state: Mapping[str, Any]) -> None:
        dirname = step_dirname(step)
        where = self._storage.url_of(dirname)
        _, _, _, others = split_state(state)
        for name, kind in manifest_entries(state, save_rng=False).items():
            saved = manifest.entries.get(name)
            if saved is None:
                raise CheckpointError(
                    f"{where} has no entry {name!r} (it has {sorted(manifest.entries)}); "
                    "remove it from the state to load the others"
                )
            if saved != kind:
                raise CheckpointError(f"{where}: entry {name!r} was saved as {saved}, not {kind}")
        per_rank = self._storage.path(dirname, rank_file(self.rank))
        if not self._storage.fs.exists(per_rank):
            raise CheckpointError(
                f"{where} was written by {manifest.world_size} ranks and has no per-rank state "
                f"for rank {self.rank}; resume with the same number of ranks"
            )
        try:
            content = self._nxd.load_checkpoint(
                **load_checkpoint_kwargs(self.root, step, state, num_workers=self.num_workers)
            )
        except Exception as e:
            raise CheckpointError(f"NxD could not load {where}: {type(e).__name__}: {e}") from e
        if not isinstance(content, Mapping) or content.get(STEP_KEY) != step:
            raise CheckpointError(
                f"{where}: NxD's user_content does not name step {step}; it was not written "
                "by NeuronCheckpointer"
            )
        restore_rank_state(
            self._storage.fs.cat_file(per_rank), others, f"{where}/{rank_file(self.rank)}"
        )


def _wait_at_exit(ref: weakref.ref[NeuronCheckpointer]) -> None:
    checkpointer = ref()
    if checkpointer is None:
        return
    try:
        checkpointer.wait()
    except Exception:
        traceback.print_exc()
        print("hlat-ckpt: the last checkpoint was not committed (see above)", file=sys.stderr)
