"""``Checkpointer``: sharded, atomic, async checkpoints with auto-resume on DCP."""

from __future__ import annotations

import builtins
import contextlib
import os
import pickle
import re
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from . import replicas, state_json
from .manifest import IncompleteCheckpointError, Manifest
from .policy import CheckpointError as CheckpointError
from .policy import CheckpointInfo as CheckpointInfo
from .policy import CheckpointPolicy, Written, checked_step
from .policy import SaveStats as SaveStats
from .rng import RNGState

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
_METADATA = ".metadata"  # DCP's index of a checkpoint's tensors


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


class Checkpointer(CheckpointPolicy[Future[None]]):
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
            recorded in the manifest as JSON: str, int, float, bool, None, lists and dicts
            with str keys (anything else is refused here).
        io_threads: file-writing threads per rank on local disks (DCP's ``thread_count``:
            each thread writes a file of its own); ``None``: 2 for a process alone on its
            node (torchrun's ``LOCAL_WORLD_SIZE``, else the world size, is 1), 1 when
            several share it.
        verify_checksums: before loading, read every file of the checkpoint and compare it
            with the checksum the manifest recorded (each rank reads the files it would
            have written); a damaged checkpoint is skipped by :meth:`load_latest` and
            refused by :meth:`load`. Checksums are always recorded.
        rank_state_from: ``f(saved_layout, saved_world_size) -> rank``: whose per-rank
            entries (loader, scheduler, RNG...) this rank loads; by default its own, which
            needs the saving job's number of ranks (at another, loading per-rank entries is
            refused, and the RNG states are left as they are). Give it to resume in another
            layout where several ranks share that state (e.g. every pipeline or
            tensor-parallel rank of one data-parallel replica reads the same data).

    ``state`` maps names to the objects to checkpoint: ``nn.Module`` (also DDP/FSDP/TP
    wrapped) and ``torch.optim.Optimizer`` entries go through
    ``torch.distributed.checkpoint.state_dict``, so sharded (DTensor) parameters are saved as
    shards by each rank and load at another parallel layout. Ranks may hold different
    parameters (pipeline stages): the checkpoint holds the union, keyed by parameter name,
    and each rank loads its own. Every other object with
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
        io_threads: int | None = None,
        verify_checksums: bool = True,
        rank_state_from: Callable[[Mapping[str, Any], int], int] | None = None,
    ):
        super().__init__(
            root_url,
            keep_last,
            keep_every,
            async_save,
            storage_options=storage_options,
            save_rng=save_rng,
            process_group=process_group,
            layout=layout or {},
            verify_checksums=verify_checksums,
        )
        if io_threads is None:
            # torchrun's LOCAL_WORLD_SIZE; without it, all ranks are taken to share a node
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
            io_threads = 2 if local == 1 else 1
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        # Note: one writing thread per rank where several ranks share a node. They already
        # write their files to its disk in parallel (one each), which is what fills a local
        # disk; more threads per rank split each rank's tensors into more, smaller files,
        # and DCP overlaps the copy of accelerator tensors to host memory with the writing
        # only at thread_count=1. A process alone on its node takes two: one thread left
        # the disk idle between files (the benchmark, hlat-ckpt 0.8: a synchronous 1.07 GB
        # save 0.689 s with one thread, 0.623 s with two, against 0.857 s for a default
        # dcp.save and 0.766 s for a raw write + fsync, medians of one run). The checksum
        # computed in the write does not make a thread CPU-bound: large buffers are
        # checksummed in a helper thread while they are written (zlib.crc32 runs at
        # 4.2 GB/s here), and torch.save's own per-record CRC is skipped.
        self.io_threads = io_threads
        self.rank_state_from = rank_state_from
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hlat-ckpt")
        self._deleting: Future[None] | None = None
        self._pending_step = -1
        self._buffers: dict[str, torch.Tensor] = {}
        self._not_mine: set[str] = set()
        self._rng = RNGState()
        self._metadata: tuple[str, Any] | None = None  # (dirname, DCP metadata) of _check

    # --- public API ------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint ``state`` as step ``step`` (collective: every rank calls it).

        With ``async_save`` this returns once the state is copied to host memory; the files
        are written and committed in the background. Waits for the previous save first and
        raises its error, if it failed, saving nothing: the error says that this step was
        not saved, and a second call saves it.
        """
        self._refuse_closed()
        step = checked_step(step)
        started = time.perf_counter()
        entries = self._classify(state)
        # Note: not saved after the failure either: a failure that some ranks saw before
        # the others finished a collective of that save would pair this save's collectives
        # with theirs and hang every rank, where raising at once ends the job
        try:
            self.wait()
        except CheckpointError as e:
            raise CheckpointError(
                f"{e}; step {step} was not saved (call save again to save it)"
            ) from e
        wait_s = time.perf_counter() - started
        name = ""
        if not self.async_save:
            name = self._prepare(step)
        else:
            self._refuse_saved(step)
        flat = self._collect(state, entries)
        layout = self._layout(flat)
        # a tensor several ranks hold (replicated over data parallelism) is staged and
        # written by one of them (hlat_ckpt.replicas)
        flat = {key: t for key, t in flat.items() if key not in self._not_mine}
        kinds = {name: kind for name, (kind, _) in entries.items()}
        if not self.async_save:
            self._write(step, name, flat, kinds, layout, started, None, wait_s)
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
        self._write(step, self._prepare(step), *args)

    def wait(self) -> None:
        """Block until the pending save is committed and the checkpoints retention dropped
        are deleted; raise :class:`~hlat_ckpt.CheckpointError` if the save failed."""
        self._settle()
        super().wait()

    def _settle(self) -> None:
        deleting, self._deleting = self._deleting, None
        if deleting is not None:
            deleting.result()

    def _delete(self, doomed: builtins.list[str]) -> None:
        """After a synchronous save, delete in the background thread: the caller has its
        checkpoint committed and goes on training; the next save (or :meth:`wait`) waits
        for the deletion. An async save is already in that thread and deletes there.

        Note: deleting a 1 GB checkpoint took about 0.17 s on a local disk here, a sixth
        of a synchronous save of the same size; torchtitan purges old checkpoints in a
        thread of its own for the same reason.
        """
        if self.async_save:
            super()._delete(doomed)
        else:
            try:
                self._deleting = self._executor.submit(super()._delete, doomed)
            except RuntimeError:  # at interpreter exit executors take no new work
                super()._delete(doomed)

    def close(self) -> None:
        """Wait for the last save and stop the background writer; the checkpointer then
        refuses to save or load (also after a ``with`` block)."""
        try:
            super().close()
        finally:
            self._executor.shutdown(wait=True)

    # --- engine hooks: the background write, reading back, checksum shares -----------------

    def _finish(self, pending: Future[None]) -> None:
        try:
            pending.result()
        except CheckpointError:
            raise
        except BaseException as e:
            raise CheckpointError(
                f"saving step {self._pending_step} to {self.url} failed in the background: "
                f"{type(e).__name__}: {e}"
            ) from e

    def _resolve(self, state: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
        return self._classify(state)

    def _checksum_share(self, names: builtins.list[str]) -> builtins.list[str]:
        return [n for n in names if _owner(n, self.world_size) == self.rank]

    def _check_written(self, sizes: dict[str, int], where: str) -> None:
        # Note: a storage on which DCP's rename of ".metadata.tmp" did nothing leaves no
        # ".metadata"; without it nothing can be loaded
        problems = [] if _METADATA in sizes else [f"no {_METADATA}"]
        unfinished = sorted(n for n in sizes if n.endswith(".tmp"))
        if unfinished:
            problems.append(f"unfinished files {unfinished}")
        if problems:
            raise CheckpointError(f"{where}: DCP's write did not complete ({'; '.join(problems)})")

    def _check_readable(self, dirname: str, manifest: Manifest) -> None:
        where = self._storage.url_of(dirname)
        self._metadata = None
        if _METADATA not in manifest.files:
            raise IncompleteCheckpointError(f"{where} has no {_METADATA} (DCP's index)")
        # this rank compared the file with the manifest's checksum (in _check, before this)
        verified = (
            self.verify_checksums
            and _METADATA in manifest.checksums
            and self._checksum_share([_METADATA]) == [_METADATA]
        )
        try:
            metadata = self._reader(dirname).read_metadata()
        except FileNotFoundError as e:
            raise IncompleteCheckpointError(f"{where}: {_METADATA} is missing") from e
        except (EOFError, pickle.UnpicklingError) as e:
            if verified:
                raise CheckpointError(
                    f"{where}: {_METADATA} cannot be read ({type(e).__name__}: {e}) although "
                    "its checksum matches the manifest's; it is not skipped as damaged"
                ) from e
            raise IncompleteCheckpointError(
                f"{where}: {_METADATA} cannot be read ({type(e).__name__}: {e})"
            ) from e
        except OSError:
            raise  # the storage failed, not the file: checking fails on every rank
        except Exception as e:
            # Note: not damage, so not skipped (load_latest would resume from an older step
            # and the run would later replace this one): this process cannot unpickle what
            # DCP wrote, as an older torch cannot read a class of a newer one. The file is
            # the same for every rank: each raises, and _check raises on all of them
            raise CheckpointError(
                f"{where}: {_METADATA} cannot be read by this process ({type(e).__name__}: "
                f"{e}); not taken as damage: was it written by a newer torch than this "
                f"{torch.__version__}?"
            ) from e
        self._metadata = (dirname, metadata)  # read once: _read takes it from here

    def _read(
        self,
        step: int,
        dirname: str,
        manifest: Manifest,
        entries: dict[str, tuple[str, Any]],
        strict: bool,
    ) -> None:
        # Note: an optimizer without state is given its state before the read (DCP's names
        # of what to read come from it); a read that fails or is refused leaves it fresh
        # again, so that a run that goes on without the checkpoint takes the first step of
        # a new optimizer, not of one a step old
        made: builtins.list[tuple[torch.optim.Optimizer, dict[str, Any]]] = []
        try:
            self._read_into(dirname, manifest, entries, strict, made)
        except BaseException:
            for optimizer, fresh in made:
                optimizer.load_state_dict(fresh)  # a state dict without state: none
            raise

    def _read_into(
        self,
        dirname: str,
        manifest: Manifest,
        entries: dict[str, tuple[str, Any]],
        strict: bool,
        made: builtins.list[tuple[torch.optim.Optimizer, dict[str, Any]]],
    ) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        where = self._storage.url_of(dirname)
        if RNG_ENTRY not in manifest.entries and entries.get(RNG_ENTRY, ("",))[0] == "rank":
            del entries[RNG_ENTRY]  # saved with save_rng=False: keep this rank's RNG as it is
        self._check_entries(where, manifest, {name: kind for name, (kind, _) in entries.items()})
        per_rank = [n for n, (kind, _) in entries.items() if kind in ("rank", "dict")]
        if self.rank_state_from is None and manifest.world_size != self.world_size:
            # Note: by default rank r loads saved rank r's entries, which are the state of
            # one rank of the saving job only. At another size some saved ranks' state would
            # go unread (fewer ranks) or some ranks would find none (more): refused on every
            # rank alike, before anything is read. The RNG states this checkpointer adds on
            # its own are not asked for by the state: this rank keeps its own.
            if RNG_ENTRY in per_rank and entries[RNG_ENTRY][1] is self._rng:
                del entries[RNG_ENTRY]
                per_rank.remove(RNG_ENTRY)
            if per_rank:
                raise CheckpointError(
                    f"{where} was written by {manifest.world_size} ranks, this job has "
                    f"{self.world_size}: the per-rank state {per_rank} of each saved rank is "
                    "loaded by the rank of the same number, so only at the same number of "
                    "ranks; to resume at another, give rank_state_from (which saved rank's "
                    "per-rank state each rank loads), or load the model and optimizer "
                    f"entries only (leave out {per_rank})"
                )

        reader = self._reader(dirname)
        checked, self._metadata = self._metadata, None
        try:
            if checked is None or checked[0] != dirname:
                checked = (dirname, reader.read_metadata())
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"reading {where} failed: {_cause(e)}") from e
        metadata = checked[1].state_dict_metadata
        request: dict[str, torch.Tensor] = {_GLOBAL_JSON: _placeholder(metadata, _GLOBAL_JSON)}
        current: dict[str, dict[str, torch.Tensor]] = {}
        keys: dict[str, builtins.list[str] | None] = {}  # None: a nested (pre-0.4) optimizer
        params: dict[str, set[str]] = {}  # the parameters of each optimizer entry, by name
        stateless: dict[str, set[str]] = {}  # of each optimizer entry, saved without state
        fresh: set[str] = set()  # optimizer entries left as they are
        problem = ""
        for name, (kind, obj) in entries.items():
            if kind in ("module", "optimizer"):
                nested = kind == "optimizer" and any(
                    k.startswith(f"{name}/state/") for k in metadata
                )
                saved = _params_of((k for k in metadata if k.startswith(f"{name}/state.")), name)
                if kind == "optimizer":
                    lacking: set[str] = set()
                    if saved and not obj[1].state and not isinstance(obj[1].state, MutableMapping):
                        lacking = _trained(*obj) - saved
                    if lacking:  # refused before its state is made: it could not be dropped
                        problem = problem or _undroppable(where, name, obj[1], lacking)
                    elif saved or nested:
                        # the names of its state: what to read (without state, a checkpoint
                        # without its state leaves it fresh)
                        if not obj[1].state:
                            made.append((obj[1], obj[1].state_dict()))
                        _init_state(obj[1])
                    elif not obj[1].state and not isinstance(obj[1].state, MutableMapping):
                        fresh.add(name)  # DCP loads no groups into it without state
                value = self._get_state_dict(kind, obj, flat=not nested)
                if kind == "optimizer" and not nested:
                    # parameters saved without state (before the optimizer's first step, or
                    # never updated) load without it
                    held = _params_of(k for k in value if k.startswith("state."))
                    stateless[name] = held - saved
                    value = {
                        k: v
                        for k, v in value.items()
                        if not (k.startswith("state.") and _param(k) in stateless[name])
                    }
                    if stateless[name] and not isinstance(obj[1].state, MutableMapping):
                        problem = problem or _undroppable(where, name, obj[1], stateless[name])
                keys[name] = None if nested else builtins.list(value)
                if kind == "optimizer":
                    params[name] = _params_of(value)
                _, tensors = state_json.split(value, name)
                absent = [k for k in tensors if k not in metadata]
                if absent and not problem:
                    on = f" on rank {self.rank}" if self._group is not None else ""
                    saved = _params_of((k for k in metadata if k.startswith(f"{name}/")), name)
                    other = all(_param(k, name) in saved for k in absent)
                    problem = (
                        f"{where}: entry {name!r} lacks {len(absent)} tensors of the current "
                        f"{kind}{on}, e.g. {absent[:3]}{_why(kind, absent, other)}"
                    )
                current[name] = tensors
                request.update(tensors)
        self._refuse_mismatch(where, metadata, entries, current, params, problem, strict)
        source = self.rank
        if self.rank_state_from is not None:
            source = self.rank_state_from(manifest.layout, manifest.world_size)
        rank_json = f"{_rank_prefix(source)}/_json"
        if per_rank:
            if rank_json not in metadata:
                raise CheckpointError(
                    f"{where} was written by {manifest.world_size} ranks and has no per-rank "
                    f"state for rank {source}; to change the number of ranks, load only the "
                    f"model and optimizer entries (leave out {per_rank})"
                )
            request[rank_json] = _placeholder(metadata, rank_json)
            for name in per_rank:
                prefix = f"{_rank_prefix(source)}/{name}/"
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
        except (Exception, CheckpointException) as e:
            # Note: DCP's CheckpointException (a tensor whose shape changed, on any rank) is
            # a BaseException; its message is every failed rank's traceback
            raise CheckpointError(f"reading {where} failed: {_cause(e)}") from e

        global_skel = state_json.loads(_tensor_bytes(request[_GLOBAL_JSON]))
        rank_skel = state_json.loads(_tensor_bytes(request[rank_json])) if per_rank else {}
        for name, (kind, obj) in entries.items():
            if kind in ("module", "optimizer"):
                skeleton = global_skel[name]
                wanted = keys[name]
                if wanted is not None:
                    # this rank's keys only: under pipeline parallelism a rank holds some
                    # layers of the whole model the checkpoint describes
                    missing = [k for k in wanted if k not in skeleton]
                    if missing:
                        saved = _params_of(skeleton)
                        other = all(_param(k) in saved for k in missing)
                        raise CheckpointError(
                            f"{where}: entry {name!r} lacks {len(missing)} entries of the "
                            f"current {kind}, e.g. {missing[:3]}{_why(kind, missing, other)}"
                        )
                    skeleton = {k: skeleton[k] for k in wanted}
                value = state_json.join(skeleton, current[name], f"{where}:{name}")
                if stateless.get(name):
                    _drop_state(obj[0], obj[1], stateless[name])
                if name not in fresh:
                    self._set_state_dict(kind, obj, value, flat=wanted is not None)
            else:
                value = state_json.join(rank_skel[name], request, f"{where}:{name}")
                if kind == "dict":
                    obj.clear()
                    obj.update(value)
                else:
                    obj.load_state_dict(value)

    def _refuse_mismatch(
        self,
        where: str,
        metadata: Mapping[str, Any],
        entries: dict[str, tuple[str, Any]],
        current: dict[str, dict[str, torch.Tensor]],
        params: dict[str, set[str]],
        problem: str,
        strict: bool,
    ) -> None:
        """Raise on every rank, before anything is read, if a rank found tensors of its
        modules or optimizers missing from the checkpoint (``problem``) or, with ``strict``,
        if a module or optimizer entry of the checkpoint holds tensors that no rank asked
        for (collective: the union of every rank's keys counts, as ranks may hold different
        parameters).

        Note: one all-reduce of two numbers when nothing is wrong and some rank leaves no
        key unread (every rank asks the same keys under FSDP, TP and DP); the keys travel
        only when every rank leaves some unread (pipeline stages, or a refusal): rank 0's
        unread keys are the candidates, and a MAX over marks of which of them each rank
        asks for leaves those no rank does.
        """
        unread: builtins.list[str] = []
        if strict:
            for name, asked in current.items():
                unread += sorted(k for k in metadata if k.startswith(f"{name}/") and k not in asked)
        # the lowest rank with a problem, and the fewest keys a rank leaves unread
        least = torch.tensor([self.rank if problem else self.world_size, len(unread)])
        if self._group is not None:
            dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self._group)
        first, fewest = int(least[0]), int(least[1])
        if first < self.world_size:
            message = [problem]
            if self._group is not None:
                src = dist.get_global_rank(self._group, first)
                dist.broadcast_object_list(message, src=src, group=self._group)
            raise CheckpointError(message[0])
        if fewest == 0:
            return
        candidates = [unread]
        if self._group is not None:
            dist.broadcast_object_list(candidates, src=self._src, group=self._group)
        # 2: this rank asks for the key; 1: it has other state of the key's parameter
        mine = []
        for key in candidates[0]:
            entry = key.partition("/")[0]
            held = _param(key, entry) in params.get(entry, ())
            mine.append(2 if key in current[entry] else int(held))
        marks = torch.tensor(mine, dtype=torch.uint8)
        if self._group is not None:
            dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=self._group)
        for name in current:
            found = [
                (key, mark)
                for key, mark in zip(candidates[0], marks.tolist(), strict=True)
                if mark < 2 and key.startswith(f"{name}/")
            ]
            if found:
                kind = entries[name][0]
                keys = [key for key, _ in found]
                other = all(mark == 1 for _, mark in found)
                raise CheckpointError(
                    f"{where}: entry {name!r} holds {len(keys)} tensors that the current "
                    f"{kind} has on no rank, e.g. {keys[:3]}{_why(kind, keys, other)} (load "
                    "with strict=False to load the others)"
                )

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
    def _get_state_dict(kind: str, obj: Any, flat: bool = True) -> dict[str, Any]:
        """The state dict of a module, or of an optimizer keyed by parameter name.

        Note: the optimizer's is flattened (``state.<fqn>.exp_avg``,
        ``param_groups.<fqn>.lr``), so every key belongs to one parameter and ranks holding
        different parameters (pipeline stages) write disjoint keys that a checkpoint
        simply unites. ``flat=False`` reads checkpoints of hlat-ckpt < 0.4, which nested
        them.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        if kind == "module":
            return get_model_state_dict(obj)
        model, optimizer = obj
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        with _not_stepped(optimizer):
            return get_optimizer_state_dict(model, optimizer, options=options)

    @staticmethod
    def _set_state_dict(kind: str, obj: Any, value: dict[str, Any], flat: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if kind == "module":
            set_model_state_dict(obj, value, options=StateDictOptions(strict=True))
        else:
            model, optimizer = obj
            options = StateDictOptions(flatten_optimizer_state_dict=flat)
            with _not_stepped(optimizer):
                set_optimizer_state_dict(model, optimizer, value, options=options)

    def _collect(
        self, state: Mapping[str, Any], entries: dict[str, tuple[str, Any]]
    ) -> dict[str, torch.Tensor]:
        flat: dict[str, torch.Tensor] = {}
        global_skel: dict[str, Any] = {}
        rank_skel: dict[str, Any] = {}
        prefix = _rank_prefix(self.rank)
        # Note: a rank whose own state cannot be saved (a set in its loader state) goes on
        # to the exchange below, so that every rank raises, not this one alone while the
        # others wait in the exchange until the group breaks
        failure: Exception | None = None
        for name, (kind, obj) in entries.items():
            if kind in ("module", "optimizer"):
                # the engines' state dicts may be collective: every rank gets them all
                value = self._get_state_dict(kind, obj)
            try:
                if kind in ("module", "optimizer"):
                    skel, tensors = state_json.split(value, name)
                    global_skel[name] = skel
                else:
                    value = dict(obj) if kind == "dict" else obj.state_dict()
                    skel, tensors = state_json.split(value, f"{prefix}/{name}")
                    rank_skel[name] = skel
            except Exception as e:
                failure = failure or e
                continue
            flat.update(tensors)
        try:
            # Serialised now, so later changes to the live objects cannot leak into an async
            # save.
            flat[f"{prefix}/_json"] = _bytes_tensor(state_json.dumps(rank_skel))
        except Exception as e:
            failure = failure or e
        self._not_mine = set()
        if self._group is None and failure is not None:
            raise failure
        if self._group is not None:
            # Ranks may hold different parameters (pipeline stages): rank 0 writes the union
            # of every rank's keys. The same exchange tells which rank writes each tensor
            # that several ranks hold.
            items = {key: replicas.item_of(t) for key, t in flat.items()}
            problem = None if failure is None else f"{type(failure).__name__}: {failure}"
            gathered: builtins.list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, (global_skel, items, problem), group=self._group)
            if failure is not None:
                raise failure
            others = [(rank, p) for rank, (_, _, p) in enumerate(gathered) if p is not None]
            if others:
                rank, problem = others[0]
                raise CheckpointError(
                    f"rank {rank} cannot save its state ({problem}); no rank wrote anything"
                )
            for other, _, _ in gathered:
                for name, skel in other.items():
                    global_skel[name] = {**skel, **global_skel[name]}
            self._not_mine = replicas.not_mine([i for _, i, _ in gathered], self.rank)
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

        Note: built beside ``dcp.async_save`` and its stager rather than on them. The
        background thread here runs, in order, the storage checks and the step agreement,
        DCP's write, the checksum commit and retention; ``dcp.async_save``'s executor runs
        DCP's write only, so the commit would need a thread of its own after its future
        anyway. And its default staging blocked longer: in the benchmark (one process,
        1.07 GB, torch 2.13) ``dcp.async_save`` blocked the caller 288 ms against 66 ms
        here (medians of 6 rounds, the same run).
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
        """DCP's writer for ``dirname``: on local disks a ``FileSystemWriter`` that
        checksums each file while writing it (:mod:`hlat_ckpt.checksum_writer`), elsewhere
        DCP's fsspec writer (the commit reads those files back to checksum them).

        Note: ``sync_files=True`` is the one fsync of each file (DCP's, after the file's
        last byte); the commit adds one of the checkpoint directory (with the manifest) and
        one of the root (after the rename), and nothing is fsynced twice.
        """
        if self._storage.is_local:
            from .checksum_writer import ChecksumWriter

            return ChecksumWriter(
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
        name: str,
        flat: dict[str, torch.Tensor],
        kinds: dict[str, str],
        layout: dict[str, Any],
        started: float,
        stall_s: float | None,
        wait_s: float,
    ) -> None:
        """Write ``step`` through DCP and commit it (collective; in the background thread for
        an async save)."""
        import torch.distributed.checkpoint as dcp

        from .checksum_writer import ChecksumWriter, zip_crc_skipped

        write_start = time.perf_counter()
        dirname = self._storage.write_dirname(name)
        where = self._storage.url_of(name)
        try:
            self._storage.makedirs(dirname)
            writer = self._writer(dirname)
            # the manifest checksums every file (in the write, or read back at the commit),
            # so torch.save's own per-record CRC would be a second pass over the same bytes;
            # the local writer's threads also skip it for the files they open
            with zip_crc_skipped():
                dcp.save(
                    flat,
                    storage_writer=writer,
                    process_group=self._group,
                    no_dist=self._group is None,
                )
        except BaseException as e:
            if self.rank == 0:
                self._discard(dirname)
            raise CheckpointError(
                f"writing step {step} to {where} failed: {_cause(e)}; earlier "
                "checkpoints are untouched"
            ) from e
        # DCP's final collective returns only after every rank's files and the metadata are
        # written, so the commit can list them and collect every rank's checksums.
        written = Written(step, kinds, layout, started, stall_s, wait_s, write_start, name)
        written.rank_bytes = sum(replicas.local_nbytes(t) for t in flat.values())
        if isinstance(writer, ChecksumWriter):
            written.checksums = writer.checksums()
            written.errors = writer.errors()
        self._commit(dirname, written)

    def _abandon(self, dirname: str) -> None:
        self._discard(dirname)

    def _discard(self, dirname: str) -> None:
        try:
            self._storage.remove_dir(dirname)
        except Exception as e:  # the original error matters more than the cleanup's
            warnings.warn(f"could not remove {self._storage.url_of(dirname)}: {e}", stacklevel=2)


def _cause(e: BaseException) -> str:
    """``e`` as ``Type: message``; for DCP's ``CheckpointException``, each failed rank's own
    error (its ``str`` is every rank's traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        return "; ".join(
            f"rank {rank}: {_cause(failure[0] if isinstance(failure, tuple) else failure)}"
            for rank, failure in sorted(e.failures.items())
        )
    return f"{type(e).__name__}: {e}"


def _param(key: str, entry: str = "") -> str | None:
    """The parameter a flat optimizer key (``state.<fqn>.<name>``,
    ``param_groups.<fqn>.<name>``, under ``<entry>/`` if given) belongs to, else ``None``."""
    if entry:
        entry_, _, key = key.partition("/")
        if entry_ != entry:
            return None
    for head in ("state.", "param_groups."):
        if key.startswith(head) and "." in key[len(head) :]:
            return key[len(head) :].rpartition(".")[0]
    return None


def _params_of(keys: Iterable[str], entry: str = "") -> set[str]:
    """The parameters of the flat optimizer keys ``keys`` (see :func:`_param`)."""
    return {p for p in (_param(k, entry) for k in keys) if p is not None}


def _why(kind: str, keys: builtins.list[str], other_state: bool) -> str:
    """How a mismatch of ``keys`` came about: another model, or (``other_state``: each key
    belongs to a parameter the other side has state of) other optimizer state."""
    if kind != "optimizer" or not other_state:
        return "; was it saved from a different model?"
    reason = "another optimizer class, or other settings of it"
    if any(k.endswith((".master", ".compensation", ".seed")) for k in keys):
        reason = (
            "a changed precision mode, master weights or Kahan compensation, or another "
            "optimizer class"
        )
    return (
        f"; the optimizer keeps other state than the checkpoint's ({reason}), and hlat-ckpt "
        "loads optimizer state of the same kind only: for such a change load the model entry "
        "alone and start the optimizer fresh"
    )


def _grads(optimizer: torch.optim.Optimizer) -> builtins.list[tuple[torch.Tensor, Any]]:
    return [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]


@contextlib.contextmanager
def _not_stepped(optimizer: torch.optim.Optimizer) -> Generator[None, None, None]:
    """Keep DCP's optimizer state-dict functions from stepping ``optimizer``.

    Note: for an optimizer without state and without grads they first run ``step()`` with
    lr=0 and zero grads (torch's ``_init_optim_state``), which creates state (AdamW: step 1)
    that a run without the save would not have; a grad on one parameter makes them skip
    it, and is taken away after.
    """
    grads = _grads(optimizer)
    if optimizer.state or not grads or any(g is not None for _, g in grads):
        yield
        return
    param = min((p for p, _ in grads), key=lambda p: p.numel())
    param.grad = torch.zeros_like(param)
    try:
        yield
    finally:
        param.grad = None


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer without state its state as DCP does (torch's ``_init_optim_state``,
    a ``step()`` with lr=0 and zero grads), whatever its grads: DCP skips it where some are
    set. The grads are kept."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    if optimizer.state:
        return
    grads = _grads(optimizer)
    for p, _ in grads:
        p.grad = None
    try:
        _init_optim_state(optimizer)
    finally:
        for p, grad in grads:
            p.grad = grad


def _undroppable(
    where: str, name: str, optimizer: torch.optim.Optimizer, stateless: set[str]
) -> str:
    return (
        f"{where}: entry {name!r} has no state of the parameters {sorted(stateless)[:3]} "
        f"(saved before their first step), and a {type(optimizer).__name__} cannot drop the "
        "state it has of them: load the model entry alone and start the optimizer fresh"
    )


def _trained(model: nn.Module, optimizer: torch.optim.Optimizer) -> set[str]:
    """DCP's names of the parameters of ``optimizer`` that require grads (those that torch's
    ``_init_optim_state`` gives state). A parameter shared by several modules (tied
    embeddings) is named once, by its first name, as DCP saves its state."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    mine = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
    return {
        fqn
        for name, param in model.named_parameters()
        if id(param) in mine
        for fqn in _get_fqns(model, name)
    }


def _drop_state(model: nn.Module, optimizer: torch.optim.Optimizer, names: set[str]) -> None:
    """Remove the state of the parameters ``names`` (DCP's names for them) from
    ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    for name, param in model.named_parameters(remove_duplicate=False):
        if _get_fqns(model, name) & names:
            optimizer.state.pop(param, None)


def _placeholder(metadata: Mapping[str, Any], key: str) -> torch.Tensor:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    item = metadata.get(key)
    if not isinstance(item, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint has no tensor {key!r}; it was not written by hlat-ckpt")
    return torch.empty(item.size, dtype=item.properties.dtype)


def _host_buffer(like: torch.Tensor, pinned: bool) -> torch.Tensor:
    """An empty CPU tensor shaped like ``like``; page-locked when it receives a copy from an
    accelerator (so the copy runs without blocking) and the device's runtime can pin."""
    if pinned:
        try:
            return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)
        except RuntimeError:  # a backend without pinned host memory
            pass
    return torch.empty(like.shape, dtype=like.dtype, device="cpu")
