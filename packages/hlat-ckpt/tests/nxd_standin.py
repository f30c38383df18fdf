"""A single-process stand-in for NxD's checkpoint calls, for testing NeuronCheckpointer's
bookkeeping on real files without a Trainium instance.

It reimplements what ``neuronx_distributed.trainer.checkpoint`` (neuronx-distributed 0.18.0,
aws-neuron/neuronx-distributed at fbac349b61a3adbb123c2983835af692840ff62f) writes and reads
without xser serialisation, on a local directory, for a job of TP 1 and PP 1 whose ranks
are all data-parallel replicas (one process, or one per rank of a torch.distributed group):

    <root>/<tag>/checkpoint                                "1", by rank 0 when the save begins
    <root>/<tag>/optim/dp_rank_<r>_tp_rank_00_pp_rank_00.pt   each rank's optimizer.state_dict()
                                                           (ZeRO-1: NxD's own optimizer)
    <root>/<tag>/optim/dp_rank_00_tp_rank_00_pp_rank_00.pt rank 0's (any other optimizer,
                                                           the same on every DP replica)
    <root>/<tag>/model/dp_rank_00_tp_rank_00_pp_rank_00.pt torch.save(model.state_dict()), rank 0
    <root>/<tag>/scheduler.pt                              scheduler.state_dict(), rank 0
    <root>/<tag>/user_content.pt                           user_content, rank 0
    <root>/<tag>/done                                      "1", by rank 0 after every write

As in NxD, an asynchronous save copies the state to host memory when called and writes the
files (and ``done``) only when the next save begins or at ``finalize_checkpoint()``; after
marking a checkpoint done, the tags without ``done`` that are older than every completed
one are removed (``num_kept_ckpts=None`` keeps all completed ones); ``load_checkpoint``
without a tag takes the newest tag with ``done`` by modification time, loads the optimizer,
then the model, then the scheduler, and returns ``user_content``. As NxD's, it loads an
optimizer of NxD's ``NeuronZero1Optimizer`` (:func:`zero1_optimizer_class`) from this
rank's ZeRO-1 file, fills a dict given in its place
(from this rank's file when the checkpoint has a second DP rank's, else rank 0's), and
raises on any other optimizer. NxD's ``xm.rendezvous`` points are ``dist.barrier()`` here.

Not reproduced: TP or PP above 1, xser, S3, an ``NxDOptimizer`` without ZeRO-1.
"""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

RANK_FILE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"
"""The model file's name (and rank 0's optimizer file's)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _rendezvous() -> None:
    if dist.is_initialized():
        dist.barrier()


def _optimizer_file(rank: int) -> str:
    return f"dp_rank_{rank:02d}_tp_rank_00_pp_rank_00.pt"


def _nxd_class(obj: Any) -> bool:
    """NxD's ``isinstance(optimizer, NeuronZero1Optimizer)`` (of the real module and name:
    :func:`zero1_optimizer_class`); its other optimizer classes are plain torch optimizers
    to it."""
    return any(
        f"{c.__module__}.{c.__qualname__}"
        == "neuronx_distributed.optimizer.zero_redundancy_optimizer.NeuronZero1Optimizer"
        for c in type(obj).__mro__
    )


def zero1_optimizer_class(base: type) -> type:
    """A subclass of ``base`` that plays NxD's ``NeuronZero1Optimizer``: its module is NxD's,
    so the stand-in (and hlat-ckpt) take it for NxD's own; as under ZeRO-1 each rank keeps
    its own optimizer state."""
    return type(
        "NeuronZero1Optimizer",
        (base,),
        {"__module__": "neuronx_distributed.optimizer.zero_redundancy_optimizer"},
    )


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu(v) for v in obj)
    return copy.deepcopy(obj)


class NxdStandIn:
    """``save_checkpoint``, ``load_checkpoint``, ``finalize_checkpoint`` and
    ``has_checkpoint`` for the calling rank; ``fail_on`` makes the save of that tag raise after its
    first file (a crash in the middle of a save)."""

    def __init__(self) -> None:
        self._async: bool | None = None
        self._root: str | None = None
        self._tag: str | None = None
        self._pending: list[tuple[Any, str]] = []
        self.fail_on: str | None = None
        self.calls: list[str] = []

    def save_checkpoint(
        self,
        checkpoint_dir_str: str,
        tag: str,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        user_content: Any = None,
        num_workers: int = 8,
        use_xser: bool = False,
        num_kept_ckpts: int | None = None,
        async_save: bool = False,
    ) -> None:
        self.calls.append(f"save {tag}")
        if use_xser:
            raise NotImplementedError("the stand-in writes NxD's layout without xser only")
        if num_kept_ckpts is not None:
            raise NotImplementedError("the stand-in keeps every completed checkpoint")
        if self._async is None:
            self._async = async_save  # NxD's io state is created once, by the first save
        if self._async and self._tag is not None:
            self._wait_save()
        self._root, self._tag = checkpoint_dir_str, tag
        rank = _rank()
        if rank == 0:
            os.makedirs(os.path.join(checkpoint_dir_str, tag), exist_ok=True)
            self._text("1", tag, "checkpoint")
        _rendezvous()
        items: list[tuple[Any, str]] = []
        if optimizer is not None and _nxd_class(optimizer):
            items.append((optimizer.state_dict(), f"{tag}/optim/{_optimizer_file(rank)}"))
        elif optimizer is not None and rank == 0:  # one writer per group of DP replicas
            items.append((optimizer.state_dict(), f"{tag}/optim/{RANK_FILE}"))
        if model is not None and rank == 0:
            items.append((model.state_dict(), f"{tag}/model/{RANK_FILE}"))
        if scheduler is not None and rank == 0:
            items.append((scheduler.state_dict(), f"{tag}/scheduler.pt"))
        if user_content is not None and rank == 0:
            items.append((user_content, f"{tag}/user_content.pt"))
        if self._async:
            self._pending = [(_cpu(obj), name) for obj, name in items]
            return
        self._write(items)
        self._mark_done()

    def finalize_checkpoint(self) -> None:
        self.calls.append("finalize")
        if self._async and self._tag is not None:
            self._wait_save()

    def has_checkpoint(self, checkpoint_dir_str: str) -> bool:
        return bool(self._tags(checkpoint_dir_str, "done"))

    def load_checkpoint(
        self,
        path: str,
        tag: str | None = None,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        num_workers: int = 8,
        strict: bool = True,
    ) -> Any:
        self.calls.append(f"load {tag}")
        if tag is None:
            completed = self._tags(path, "done")
            if not completed:
                raise RuntimeError(f"Error: no checkpoint under directory {path}")
            tag = completed[-1]
        base = os.path.join(path, tag)
        if optimizer is not None:
            if _nxd_class(optimizer):
                zero1 = True
            elif isinstance(optimizer, dict):
                zero1 = os.path.exists(f"{base}/optim/{_optimizer_file(1)}")
            else:
                raise RuntimeError(
                    "Error: invalid type for the argument optimizer for load_checkpoint, "
                    "expecting a dict or NxDOptimizer, or NeuronZero1Optimizer, got "
                    f"{type(optimizer)}"
                )
            file = _optimizer_file(_rank() if zero1 else 0)
            state = torch.load(f"{base}/optim/{file}", weights_only=False)
            if isinstance(optimizer, dict):
                for key in state:
                    optimizer[key] = state[key]
            else:
                optimizer.load_state_dict(state)
        if model is not None:
            state = torch.load(f"{base}/model/{RANK_FILE}", weights_only=False)
            model.load_state_dict(state, strict=strict)
        if scheduler is not None:
            scheduler.load_state_dict(torch.load(f"{base}/scheduler.pt", weights_only=False))
        content = f"{base}/user_content.pt"
        found = torch.load(content, weights_only=False) if os.path.exists(content) else None
        _rendezvous()
        return found

    # --- NxD's CheckpointIOState, for one rank ---------------------------------------------

    def _wait_save(self) -> None:
        self._write(self._pending)
        self._pending = []
        self._mark_done()

    def _mark_done(self) -> None:
        assert self._tag is not None
        _rendezvous()
        if _rank() == 0:
            self._text("1", self._tag, "done")
        _rendezvous()
        if _rank() == 0:
            self._remove_corrupted()
        _rendezvous()

    def _write(self, items: list[tuple[Any, str]]) -> None:
        assert self._root is not None
        for index, (obj, name) in enumerate(items):
            if index == 1 and self.fail_on is not None and name.startswith(self.fail_on + "/"):
                raise OSError(f"no space left on device while writing {name}")
            target = os.path.join(self._root, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            torch.save(obj, target)

    def _text(self, text: str, *parts: str) -> None:
        assert self._root is not None
        with open(os.path.join(self._root, *parts), "w") as f:
            f.write(text)

    def _tags(self, root: str, marker: str) -> list[str]:
        """Tags holding ``marker``, oldest first by its modification time."""
        if not os.path.isdir(root):
            return []
        found = [t for t in os.listdir(root) if os.path.isfile(os.path.join(root, t, marker))]
        return sorted(found, key=lambda t: os.path.getmtime(os.path.join(root, t, marker)))

    def _remove_corrupted(self) -> None:
        """NxD's ``_determine_remove_tags`` with ``num_kept=None``: tags without ``done``
        that come before the first completed one (leftovers of interrupted deletions)."""
        assert self._root is not None
        doomed = []
        for tag in self._tags(self._root, "checkpoint"):
            if os.path.isfile(os.path.join(self._root, tag, "done")):
                break
            doomed.append(tag)
        for tag in doomed:
            shutil.rmtree(os.path.join(self._root, tag), ignore_errors=True)
