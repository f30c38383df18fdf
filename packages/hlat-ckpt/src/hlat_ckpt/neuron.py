"""The same checkpoint interface on AWS Trainium, through NeuronX Distributed (NxD).

NxD's ``trainer.save_checkpoint`` writes each rank's model and optimizer shards itself (with
xser serialisation, async saving and retention of ``num_kept_ckpts``) and marks a complete
checkpoint with a ``done`` file; ``load_checkpoint(path, tag=None)`` resumes from the newest
such tag. This module maps a ``{name: object}`` state onto those calls. NxD is imported only
when a :class:`NeuronCheckpointer` is created.

Note: the argument mapping is unit-tested anywhere; the calls into NxD need a trn1/trn2
instance with the Neuron SDK to verify. NxD stores non-tensor state with ``torch.save``
(pickle), so the trust model of this backend is NxD's, not hlat-ckpt's JSON one.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Mapping
from typing import Any

import fsspec
import torch
from torch import nn

from .rng import RNGState
from .storage import step_dirname

_STEP_KEY = "hlat_step"


def split_state(state: Mapping[str, Any]) -> tuple[nn.Module, Any, Any, dict[str, Any]]:
    """``(model, optimizer, scheduler, others)`` of a state mapping for NxD.

    NxD saves exactly one model, at most one optimizer and one scheduler itself; every other
    entry (data loader, counters, RNG) travels in ``user_content`` by name.
    """
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


def save_checkpoint_kwargs(
    root: str,
    step: int,
    state: Mapping[str, Any],
    *,
    keep_last: int | None = 5,
    async_save: bool = True,
    use_xser: bool = True,
    num_workers: int = 8,
    save_rng: bool = True,
) -> dict[str, Any]:
    """Keyword arguments of ``neuronx_distributed.trainer.save_checkpoint`` for ``state``."""
    model, optimizer, scheduler, others = split_state(state)
    user_content: dict[str, Any] = {_STEP_KEY: step}
    for name, obj in others.items():
        user_content[name] = dict(obj) if isinstance(obj, dict) else obj.state_dict()
    if save_rng and "rng" not in others:
        user_content["rng"] = RNGState().state_dict()
    return {
        "checkpoint_dir_str": root,
        "tag": step_dirname(step),
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "user_content": user_content,
        "num_workers": num_workers,
        "use_xser": use_xser,
        "num_kept_ckpts": keep_last,
        "async_save": async_save,
    }


def load_checkpoint_kwargs(
    root: str, step: int | None, state: Mapping[str, Any], *, num_workers: int = 8
) -> dict[str, Any]:
    """Keyword arguments of ``neuronx_distributed.trainer.load_checkpoint`` (``step=None``:
    the newest complete tag)."""
    model, optimizer, scheduler, _ = split_state(state)
    return {
        "path": root,
        "tag": None if step is None else step_dirname(step),
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "num_workers": num_workers,
    }


def apply_user_content(user_content: Mapping[str, Any], state: Mapping[str, Any]) -> int:
    """Restore the non-model entries of ``state`` from NxD's ``user_content``; return the step."""
    if not isinstance(user_content, Mapping) or _STEP_KEY not in user_content:
        raise ValueError("the checkpoint's user_content was not written by NeuronCheckpointer")
    _, _, _, others = split_state(state)
    for name, obj in others.items():
        if name not in user_content:
            raise KeyError(f"the checkpoint has no entry {name!r}")
        if isinstance(obj, dict):
            obj.clear()
            obj.update(user_content[name])
        else:
            obj.load_state_dict(user_content[name])
    if "rng" in user_content and "rng" not in others:
        RNGState().load_state_dict(user_content["rng"])
    return int(user_content[_STEP_KEY])


class NeuronCheckpointer:
    """:class:`~hlat_ckpt.Checkpointer`'s interface on Trainium, backed by NxD's checkpointing.

    Use it with models built by NxD (``initialize_parallel_model``); ``root_url`` is what NxD
    accepts (a local or shared path, or ``s3://``).
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        keep_last: int | None = 5,
        async_save: bool = True,
        *,
        use_xser: bool = True,
        num_workers: int = 8,
        save_rng: bool = True,
    ):
        try:
            from neuronx_distributed import trainer
        except Exception as e:  # the PyPI placeholder raises on import, not only ImportError
            raise RuntimeError(
                "NeuronCheckpointer needs neuronx-distributed and torch-neuronx from the "
                "Neuron package repository (on a trn1/trn2 instance); use Checkpointer "
                f"elsewhere ({type(e).__name__}: {e})"
            ) from e
        self._trainer = trainer
        self.root = os.fspath(root_url)
        self.keep_last = keep_last
        self.async_save = async_save
        self.use_xser = use_xser
        self.num_workers = num_workers
        self.save_rng = save_rng

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint ``state`` as step ``step`` through ``save_checkpoint``."""
        self._trainer.save_checkpoint(
            **save_checkpoint_kwargs(
                self.root,
                step,
                state,
                keep_last=self.keep_last,
                async_save=self.async_save,
                use_xser=self.use_xser,
                num_workers=self.num_workers,
                save_rng=self.save_rng,
            )
        )

    def load_latest(self, state: Mapping[str, Any]) -> int | None:
        """Load the newest complete checkpoint; ``None`` when there is none."""
        if not self._trainer.has_checkpoint(self.root):
            return None
        return self._load(None, state)

    def load(self, step: int, state: Mapping[str, Any]) -> None:
        """Load checkpoint ``step``."""
        self._load(step, state)

    def _load(self, step: int | None, state: Mapping[str, Any]) -> int:
        kwargs = load_checkpoint_kwargs(self.root, step, state, num_workers=self.num_workers)
        return apply_user_content(self._trainer.load_checkpoint(**kwargs), state)

    def wait(self) -> None:
        """Block until NxD's async save has finished."""
        self._trainer.finalize_checkpoint()

    def list(self) -> builtins.list[int]:
        """Steps of the complete checkpoints (those with NxD's ``done`` marker), oldest first."""
        fs, root = fsspec.core.url_to_fs(self.root)
        steps = []
        for path in fs.ls(root, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("step_") and name[5:].isdigit() and fs.exists(f"{path}/done"):
                steps.append(int(name[5:]))
        return sorted(steps)
