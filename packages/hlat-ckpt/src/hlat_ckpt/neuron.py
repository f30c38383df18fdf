"""The checkpoint interface of :class:`~hlat_ckpt.Checkpointer` on AWS Trainium (trn1),
writing the model and optimizer shards through NeuronX Distributed (NxD).

Written against neuronx-distributed 0.18.0 (Neuron SDK 2.29, aws-neuron/neuronx-distributed
at fbac349b61a3adbb123c2983835af692840ff62f): ``save_checkpoint``, ``load_checkpoint`` and
``finalize_checkpoint``. NxD writes each rank's model and optimizer shards (one file per
TP rank and, for ZeRO-1, per DP rank: NxD's parallel layers hold plain per-rank tensors,
which ``torch.distributed.checkpoint`` would save as one replicated copy), the scheduler and
``user_content`` from rank 0, and a ``done`` file. Around that, hlat-ckpt's semantics are
:class:`~hlat_ckpt.policy.CheckpointPolicy`'s, as for :class:`~hlat_ckpt.Checkpointer`:

- a checkpoint is complete only once ``hlat-checkpoint.json`` (the manifest of
  :mod:`hlat_ckpt.manifest`, with every file's size and CRC-32) is written, after NxD's
  ``done``; resume picks the newest complete one and, with ``verify_checksums``, skips a
  damaged one for the one before;
- per-rank state (data loader, counters, RNG) is saved by every rank, in
  ``hlat-rank/rank_<rank>.pt`` (NxD's ``user_content`` is rank 0's only);
- retention (keep the last N) is done by hlat-ckpt after each commit, and never removes
  anything when a save fails. NxD deletes no checkpoint it marked ``done``
  (``num_kept_ckpts=None``); after each save it still removes the tags it began (its
  ``checkpoint`` marker) and never marked ``done`` that are older than its oldest ``done``
  one: saves that failed, which hlat-ckpt never committed;
- an optimizer of NxD's own classes (``NeuronZero1Optimizer``, ``NxDOptimizer``) is loaded by
  NxD itself; NxD's ``load_checkpoint`` refuses any other (it saves them all), so another
  optimizer (a plain ``torch.optim`` one, without ZeRO-1) is loaded through a dict that NxD
  fills, then its ``load_state_dict`` (:func:`load_checkpoint_kwargs`).

The argument mapping and the bookkeeping are tested without NxD; the calls into NxD are
unverified on hardware (they need a trn1 instance with the Neuron SDK). Trust model: NxD
saves its files with ``torch.save`` and loads them with pickle; load only checkpoints you
trust. The per-rank files hold JSON and tensors, loaded with ``weights_only=True``.
"""

from __future__ import annotations

import builtins
import io
import os
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import state_json
from .manifest import MANIFEST_NAME, Manifest
from .policy import CheckpointError, CheckpointPolicy, Written, checked_step
from .policy import CheckpointInfo as CheckpointInfo  # importable from here, as before
from .policy import SaveStats as SaveStats
from .rng import RNGState
from .storage import step_dirname

STEP_KEY = "hlat_step"
"""The step, in NxD's ``user_content``."""
DONE = "done"
"""NxD's marker of a checkpoint it finished writing."""
RANK_DIR = "hlat-rank"
"""Where each rank's own state goes inside a checkpoint."""
RNG_ENTRY = "rng"
_RANK_FORMAT = "hlat-rank-state"
_NXD_MODES: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
"""``async_save`` of the first save handed to each NxD module of this process: NxD fixes
synchronous or asynchronous saving then, for the whole process (its first
``save_checkpoint`` creates its one ``CheckpointIOState``)."""


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
    tag: str = "",
) -> dict[str, Any]:
    """Keyword arguments of ``neuronx_distributed.save_checkpoint`` for ``state``, into the
    checkpoint directory ``tag`` (default ``step_<N>``).

    Note: ``num_kept_ckpts`` is ``None``: NxD would count the checkpoints it marked
    ``done``, including ones hlat-ckpt never committed or found damaged, and delete the
    oldest; retention is :class:`NeuronCheckpointer`'s, after its commit.
    """
    model, optimizer, scheduler, _ = split_state(state)
    return {
        "checkpoint_dir_str": root,
        "tag": tag or step_dirname(step),
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "user_content": {STEP_KEY: step},
        "num_workers": num_workers,
        "use_xser": use_xser,
        "num_kept_ckpts": None,
        "async_save": async_save,
    }


NXD_OPTIMIZERS = frozenset(
    {
        "neuronx_distributed.optimizer.zero_redundancy_optimizer.NeuronZero1Optimizer",
        "neuronx_distributed.trainer.optimizer.NxDOptimizer",
    }
)
"""The optimizer classes NxD's ``load_checkpoint`` accepts as they are (and their
subclasses, such as ``NeuronEPZero1Optimizer``), by module and name."""


def nxd_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is of one of :data:`NXD_OPTIMIZERS` or a subclass: NxD's
    ``isinstance`` test, without importing NxD. Other optimizers of the ``neuronx_distributed``
    package (``AdamW_FP32OptimParams``: a plain torch optimizer) are not, and NxD's
    ``load_checkpoint`` raises on them."""
    return any(
        f"{c.__module__}.{c.__qualname__}" in NXD_OPTIMIZERS for c in type(optimizer).__mro__
    )


def load_checkpoint_kwargs(
    root: str,
    step: int,
    state: Mapping[str, Any],
    *,
    num_workers: int = 8,
    tag: str = "",
    strict: bool = True,
) -> dict[str, Any]:
    """Keyword arguments of ``neuronx_distributed.load_checkpoint`` for step ``step``, from
    the checkpoint directory ``tag`` (default ``step_<N>``); ``strict`` is NxD's, which it
    passes to the model's ``load_state_dict``: ``strict=False`` there also leaves the
    model's parameters that the checkpoint lacks as they are, unlike
    :class:`~hlat_ckpt.Checkpointer`'s, which refuses those in any case.

    The optimizer is passed as it is when it is one of NxD's (:func:`nxd_optimizer`); any
    other is replaced by an empty dict, the form NxD's ``load_checkpoint`` takes for
    optimizers that are not its own (it raises ``RuntimeError`` on them), which it fills with
    the saved state dict: load that into the optimizer after the call
    (:class:`NeuronCheckpointer` does).

    Note: the tag is always given: without one NxD takes the newest tag with a ``done``
    file (by modification time), which may be one hlat-ckpt has not committed or has found
    damaged.
    """
    model, optimizer, scheduler, _ = split_state(state)
    return {
        "path": root,
        "tag": tag or step_dirname(step),
        "model": model,
        "optimizer": optimizer if optimizer is None or nxd_optimizer(optimizer) else {},
        "scheduler": scheduler,
        "num_workers": num_workers,
        "strict": strict,
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


class NeuronCheckpointer(CheckpointPolicy[Written]):
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
        layout: free-form description of the parallel layout, recorded in the manifest as
            JSON (as :class:`~hlat_ckpt.Checkpointer`'s).
        verify_checksums: before loading, read every file back and compare it with the
            manifest's checksum (the ranks share the reading); a damaged checkpoint is
            skipped by :meth:`load_latest` and refused by :meth:`load`.
        use_xser: NxD's tensor-per-file serialisation (faster; NxD's default off).
        num_workers: NxD's number of ranks per node writing or reading at once.
        nxd: the module providing ``save_checkpoint``, ``load_checkpoint`` and
            ``finalize_checkpoint``; default ``neuronx_distributed``, imported here.

    ``state`` maps names to one ``nn.Module`` (built with NxD's parallel layers), at most one
    optimizer (NxD's ``NeuronZero1Optimizer``, or any ``torch.optim`` optimizer: see
    :func:`load_checkpoint_kwargs`) and one LR scheduler, which NxD saves, and any other
    objects with ``state_dict()/load_state_dict()`` or plain dicts, saved per rank.

    For an asynchronous save, the :class:`~hlat_ckpt.SaveStats` of :meth:`pop_save_stats`
    count as ``stall_s`` the time :meth:`save` blocked (NxD's copy to host memory, after
    ``wait_s`` committing the previous save), as ``write_s`` the time the commit blocked
    (waiting for NxD's writes, checksumming, the manifest); ``save_s`` runs from the call of
    :meth:`save` to the commit, training in between.

    ``strict`` of :meth:`load` and :meth:`load_latest` goes to NxD's ``load_checkpoint``
    (the model's ``load_state_dict``): ``strict=False`` skips the model's parameters that
    the checkpoint lacks too, which :class:`~hlat_ckpt.Checkpointer` refuses in any case.

    Note: construct it on every rank in the same order (it creates a process group) and
    call :meth:`close` (or :meth:`wait`) before the process group is destroyed. NxD saves
    synchronously or asynchronously as its first ``save_checkpoint`` in the process did, so
    a process saves with one ``async_save``: a save with the other is refused before any
    work.
    """

    _markers = (MANIFEST_NAME, DONE)
    _after_failed_commit = (
        "it stays uncommitted (resume skips it) and earlier checkpoints are untouched"
    )

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
        super().__init__(
            root_url,
            keep_last,
            keep_every,
            async_save,
            storage_options=storage_options,
            save_rng=save_rng,
            process_group=process_group,
            layout={"backend": "nxd", **(layout or {})},
            verify_checksums=verify_checksums,
        )
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
        self.root = os.fspath(root_url)
        self.use_xser = use_xser
        self.num_workers = num_workers

    # --- public API ------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint ``state`` as step ``step`` (collective: every rank calls it).

        Commits the previous asynchronous save first (raising its error, if it failed).
        With ``async_save`` this returns once NxD has copied the shards to host memory;
        the checkpoint is committed by the next :meth:`save`, :meth:`wait` or :meth:`close`.
        """
        self._refuse_closed()
        step = checked_step(step)
        first = _NXD_MODES.get(self._nxd)
        if first is not None and first != self.async_save:
            raise ValueError(
                f"this NeuronCheckpointer has async_save={self.async_save}, but this process "
                f"already saved through NxD with async_save={first}, and NxD keeps the mode of "
                "its first save_checkpoint for the whole process: use one async_save per process"
            )
        started = time.perf_counter()
        _, _, _, others = split_state(state)
        entries = manifest_entries(state, self.save_rng)
        self.wait()
        wait_s = time.perf_counter() - started
        self._refuse_saved(step)
        dirname = self._prepare(step)
        where = self._storage.url_of(dirname)
        write_start = time.perf_counter()
        try:
            data = rank_state_bytes(others, self.save_rng)
            self._storage.makedirs(dirname, RANK_DIR)
            with self._storage.fs.open(
                self._storage.path(dirname, rank_file(self.rank)), "wb"
            ) as f:
                f.write(data)
            _NXD_MODES.setdefault(self._nxd, self.async_save)
            self._nxd.save_checkpoint(
                **save_checkpoint_kwargs(
                    self.root,
                    step,
                    state,
                    async_save=self.async_save,
                    use_xser=self.use_xser,
                    num_workers=self.num_workers,
                    tag=dirname,
                )
            )
        except BaseException as e:
            raise CheckpointError(
                f"saving step {step} to {where} failed: {type(e).__name__}: {e}; earlier "
                "checkpoints are untouched"
            ) from e
        written = Written(step, entries, self.layout, started, None, wait_s, write_start, dirname)
        if self.async_save:
            written.stall_s = time.perf_counter() - started
            self._pending = written
        else:
            self._commit(dirname, written)

    # --- engine hooks: NxD's finalize, reading back, checksum shares -----------------------

    def _finish(self, pending: Written) -> None:
        """Finish the pending asynchronous save (NxD's ``finalize_checkpoint``) and commit it
        (collective)."""
        pending.write_start = time.perf_counter()
        try:
            self._nxd.finalize_checkpoint()
        except BaseException as e:
            raise CheckpointError(
                f"saving step {pending.step} to {self.url} failed in the background: "
                f"{type(e).__name__}: {e}; earlier checkpoints are untouched"
            ) from e
        self._commit(pending.name, pending)

    def _resolve(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        split_state(state)
        return state

    def _checksum_share(self, names: builtins.list[str]) -> builtins.list[str]:
        return checksum_share(names, self.rank, self.world_size)

    def _check_written(self, sizes: dict[str, int], where: str) -> None:
        if DONE not in sizes:
            raise CheckpointError(f"NxD did not mark {where} {DONE}")

    def _read(
        self, step: int, dirname: str, manifest: Manifest, state: Mapping[str, Any], strict: bool
    ) -> None:
        where = self._storage.url_of(dirname)
        _, optimizer, _, others = split_state(state)
        self._check_entries(where, manifest, manifest_entries(state, save_rng=False))
        if manifest.world_size != self.world_size:
            # rank r loads saved rank r's state: at another size some saved ranks' state
            # would go unread, or some ranks would find none; refused on every rank alike
            raise CheckpointError(
                f"{where} was written by {manifest.world_size} ranks, this job has "
                f"{self.world_size}: NxD's shards and each rank's per-rank state resume at "
                "the same number of ranks only"
            )
        per_rank = self._storage.path(dirname, rank_file(self.rank))
        if not self._storage.fs.exists(per_rank):
            raise CheckpointError(
                f"{where} was written by {manifest.world_size} ranks and has no per-rank state "
                f"for rank {self.rank}; resume with the same number of ranks"
            )
        kwargs = load_checkpoint_kwargs(
            self.root, step, state, num_workers=self.num_workers, tag=dirname, strict=strict
        )
        try:
            content = self._nxd.load_checkpoint(**kwargs)
        except Exception as e:
            raise CheckpointError(f"NxD could not load {where}: {type(e).__name__}: {e}") from e
        if optimizer is not None and kwargs["optimizer"] is not optimizer:
            if not kwargs["optimizer"]:
                raise CheckpointError(f"NxD loaded no optimizer state from {where}")
            try:
                optimizer.load_state_dict(kwargs["optimizer"])
            except Exception as e:
                raise CheckpointError(
                    f"{where}: the optimizer state NxD loaded does not fit the optimizer "
                    f"({type(e).__name__}: {e})"
                ) from e
        if not isinstance(content, Mapping) or content.get(STEP_KEY) != step:
            raise CheckpointError(
                f"{where}: NxD's user_content does not name step {step}; it was not written "
                "by NeuronCheckpointer"
            )
        restore_rank_state(
            self._storage.fs.cat_file(per_rank), others, f"{where}/{rank_file(self.rank)}"
        )
