"""The Trainium (trn1) backend of the trainer: the recipe's environment, XLA step marking,
and the pieces a training loop on NeuronX Distributed (NxD) calls.

:func:`neuron_env` is pure (config in, variables out) and tested anywhere;
:func:`apply_neuron_env` sets them in ``os.environ`` before ``torch_xla`` is imported.
Running on Trainium needs a trn1 instance with the Neuron SDK to verify.

A training loop on this backend, in order (``dims.backend == "neuron"``):

- setup: :func:`apply_neuron_env`; ``dims = init_parallel(tp, sp, "neuron")``; log
  :func:`describe_precision`; build the model (on ``meta`` for large ones) cast to
  ``zero1_precision(precision).param_dtype``, ``parallelize`` it, then for a meta model
  ``model.to_empty(device=dims.device)`` and :func:`neuron_init_weights` (not
  ``model.init_weights()``); :func:`neuron_optimizer`; the LR scheduler on it;
  :func:`neuron_checkpointer` and ``load_latest``.
- each step: ``loss = neuron_loss(model(ids), labels) / grad_accum``, ``loss.backward()``
  per micro-batch (no ``no_grad_sync``, no ``loss_parallel``); then ``optimizer.step()``
  without clipping first (ZeRO-1 clips to ``optim.clip`` inside), :func:`neuron_grad_norm`,
  ``optimizer.zero_grad()``, ``scheduler.step()``, :func:`mark_step`.
- checkpoints: ``save(step, state)``, ``pop_save_stats()``, and ``close()`` at the end.

Those functions call NxD and are unverified on hardware; the arguments they compute are
tested (:func:`neuron_optimizer_kwargs`, :func:`neuron_checkpointer_kwargs`,
:func:`describe_precision`).

Pre-compiling: run the training command itself, on the same nodes and layout (the graphs
depend on DP too), under ``neuron_parallel_compile`` with a few steps
(``srun neuron_parallel_compile torchrun --nnodes 64 --nproc-per-node 32 ... -m hlat_train
train --config hlat-7b ... --train.steps=10``); it traces every graph and compiles them in
parallel into the compile cache (``neuron.cache_dir``, passed as ``--cache_dir`` in
``NEURON_CC_FLAGS``; default ``/var/tmp/neuron-compile-cache``). While it collects graphs
(:func:`extracting_graphs`) the trainer does not act on the values it reads back. On a
cluster, compile once into shared storage, then copy the cache to each node's local disk
and point ``neuron.cache_dir`` there: HLAT found shared storage too slow to serve the cache
to every node (``docs/cluster/compile-cache.md``).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hlat_train.config import NeuronConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hlat_ckpt.neuron import NeuronCheckpointer
    from hlat_parallel import ParallelDims
    from hlat_train.config import TrainConfig

LLM_TRAINING_FLAG = "--distribution-strategy=llm-training"
STOCHASTIC_ROUNDING = "NEURON_RT_STOCHASTIC_ROUNDING_EN"
DEPRECATED_BF16_SWITCHES = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")
"""torch-xla's switches that store every fp32 tensor as bf16 on the device; the trainer
casts the model explicitly instead."""


def neuron_env(
    config: NeuronConfig, precision: str = "bf16-sr", multi_node: bool = False
) -> dict[str, str]:
    """The environment variables of the recipe for ``config``.

    ``precision`` maps to the hardware switches: ``bf16-sr`` sets
    ``NEURON_RT_STOCHASTIC_ROUNDING_EN=1`` (the model is cast to bf16 by the trainer);
    ``bf16``, ``mixed`` and ``fp32`` set it to 0 (see
    ``hlat_parallel.neuron_backend.zero1_precision``, which refuses ``bf16-kahan`` here).
    EFA variables are set for multi-node runs.
    """
    from hlat_parallel.neuron_backend import zero1_precision

    rounding = zero1_precision(precision).stochastic_rounding
    flags = shlex.split(config.cc_flags)
    flags = [f for f in flags if f != LLM_TRAINING_FLAG]
    if config.llm_training_strategy:
        flags.append(LLM_TRAINING_FLAG)
    if config.cache_dir:
        flags.append(f"--cache_dir={config.cache_dir}")
    env = {
        "NEURON_CC_FLAGS": " ".join(flags),
        "NEURON_FUSE_SOFTMAX": "1" if config.fuse_softmax else "0",
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": str(config.inflight_requests),
        "MALLOC_ARENA_MAX": str(config.malloc_arena_max),
        STOCHASTIC_ROUNDING: "1" if rounding else "0",
    }
    if config.cache_dir:
        env["NEURON_COMPILE_CACHE_URL"] = config.cache_dir
    if multi_node and config.efa:
        env.update(FI_PROVIDER="efa", FI_EFA_USE_DEVICE_RDMA="1", FI_EFA_FORK_SAFE="1")
    return env


def apply_neuron_env(config: NeuronConfig, precision: str, multi_node: bool) -> dict[str, str]:
    """Set :func:`neuron_env` in ``os.environ``; a variable the user already set wins.

    Returns what was set. Call before anything imports ``torch_xla``.
    """
    applied = {}
    for key, value in neuron_env(config, precision, multi_node).items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


EXTRACT_GRAPHS_ONLY = "NEURON_EXTRACT_GRAPHS_ONLY"
"""Set by ``neuron_parallel_compile`` in the processes it runs to collect graphs."""


def extracting_graphs(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs under ``neuron_parallel_compile``'s graph extraction
    (:data:`EXTRACT_GRAPHS_ONLY` set, to anything non-empty, as NxD's own training scripts
    read it): the graphs are traced and collected, not executed, so every value read back
    from the device is meaningless. The trainer still reads what it reads in a real run (a
    host read ends a graph, so skipping it would collect other graphs), but does not act on
    the verdicts it reads (no skipped update, no rollback)."""
    return bool((os.environ if env is None else env).get(EXTRACT_GRAPHS_ONLY))


_xla_model: Any = None
_xla_looked_up = False


def mark_step() -> Any:
    """End the traced XLA graph of this step (``xm.mark_step``); a no-op off Neuron.

    Note: ``torch_xla`` is looked up once per process; a failed import is not cached by
    Python, and retrying it every step would search the whole module path each time.
    """
    global _xla_model, _xla_looked_up
    if not _xla_looked_up:
        try:
            import torch_xla.core.xla_model as xm
        except Exception:  # not on an XLA device
            xm = None
        _xla_model, _xla_looked_up = xm, True
    return None if _xla_model is None else _xla_model.mark_step()


def describe_precision(precision: str, env: Mapping[str, str] | None = None) -> str:
    """One line saying how ``precision`` runs on NxD, for the trainer to log at start; raises
    :class:`ValueError` when the environment (default ``os.environ``) would make it run
    otherwise.

    The rounding switch must say what the mode means (``1`` for ``bf16-sr``, ``0``
    otherwise; :func:`apply_neuron_env` sets it, but a value the user set wins), and
    torch-xla's deprecated bf16 switches must be off: they would turn fp32 tensors (the
    master weights of ``mixed``, all of ``fp32``) into bf16 on the device.
    """
    from hlat_parallel.neuron_backend import zero1_precision

    settings = zero1_precision(precision)
    env = os.environ if env is None else env
    for name in DEPRECATED_BF16_SWITCHES:
        if env.get(name, "0") not in ("", "0"):
            raise ValueError(
                f"{name}={env[name]} stores fp32 tensors as bf16 on the device, so precision "
                f"{precision} would not run as configured; unset it (the trainer casts the "
                "model to the precision's dtype itself)"
            )
    wanted = "1" if settings.stochastic_rounding else "0"
    found = env.get(STOCHASTIC_ROUNDING)
    if found != wanted:
        what = "is not set" if found is None else f"is {found!r}"
        raise ValueError(
            f"precision {precision} needs {STOCHASTIC_ROUNDING}={wanted}, but it {what}; call "
            f"apply_neuron_env before anything imports torch_xla, or unset it, or choose the "
            f"precision that means what it says ({'bf16-sr' if found == '1' else 'bf16'})"
        )
    return settings.description


def neuron_init_weights(model: nn.Module, dims: ParallelDims, seed: int) -> None:
    """Initialise a model that was built on ``meta``, parallelised and materialised with
    ``model.to_empty(device=dims.device)``: ``model.init_weights()`` with the RNG seeded per
    TP rank, so the shards of a split weight differ, and replicated weights made equal over
    TP (``hlat_parallel.neuron_backend.init_sharded_weights``)."""
    from hlat_parallel.neuron_backend import init_sharded_weights

    init_sharded_weights(model, dims, seed)


def neuron_optimizer_kwargs(config: TrainConfig) -> dict[str, Any]:
    """The keyword arguments :func:`neuron_optimizer` gives ``shard_optimizer``: AdamW's
    hyper-parameters, the precision's ZeRO-1 dtype settings and the configured clip
    (``optim.clip``, 0 for none)."""
    from hlat_parallel.neuron_backend import zero1_clip, zero1_precision

    o = config.optim
    return {
        "lr": o.lr,
        "betas": (o.beta1, o.beta2),
        "eps": o.eps,
        "weight_decay": o.weight_decay,
        **zero1_precision(o.precision).zero1_kwargs(),
        **zero1_clip(o.clip),
    }


def neuron_optimizer(
    config: TrainConfig, model: nn.Module, dims: ParallelDims
) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` inside NxD's ``NeuronZero1Optimizer`` (states sharded over DP),
    with the precision's ``optimizer_dtype`` and one global gradient-norm clip at
    ``optim.clip``, computed inside ``step()``: do not clip before it on this backend.

    Note: ``torch.optim.AdamW``, not ``hlat_optim.AdamW``: on Trainium the bf16 rounding is
    the hardware's (``bf16-sr``), and hlat-optim's update is built for CPU and CUDA.
    ``optim.impl`` does not apply.
    """
    import torch

    from hlat_parallel import shard_optimizer
    from hlat_parallel.neuron_backend import check_nxd_attributes, zero1_precision

    if dims.backend != "neuron":
        raise ValueError(
            f"neuron_optimizer needs dims of the neuron backend, got {dims.backend!r}; "
            "build the optimizer with shard_optimizer on the torch backend"
        )
    settings = zero1_precision(config.optim.precision)
    found = sorted({str(p.dtype) for p in model.parameters() if p.dtype != settings.param_dtype})
    if found:
        raise ValueError(
            f"precision {settings.mode} trains {settings.param_dtype} weights, but the model "
            f"has {', '.join(found)} ones; cast it with model.to({settings.param_dtype}) before "
            "parallelize()"
        )
    check_nxd_attributes(model)
    return shard_optimizer(
        torch.optim.AdamW, model.parameters(), dims, **neuron_optimizer_kwargs(config)
    )


def neuron_checkpointer_kwargs(config: TrainConfig, dims: ParallelDims) -> dict[str, Any]:
    """The arguments of the :class:`~hlat_ckpt.neuron.NeuronCheckpointer` of
    :func:`neuron_checkpointer`."""
    c = config.checkpoint
    return {
        "root_url": config.checkpoint_dir,
        "keep_last": c.keep_last,
        "async_save": c.async_save,
        "verify_checksums": c.verify_checksums,
        "layout": {"tp": dims.tp, "dp": dims.dp, "sp": dims.sp},
    }


def neuron_checkpointer(config: TrainConfig, dims: ParallelDims) -> NeuronCheckpointer:
    """hlat-ckpt's checkpointer on NxD's ``save_checkpoint``/``load_checkpoint``: the same
    ``save``, ``load_latest``, ``wait``, ``list``, ``pop_save_stats`` and ``close`` as
    ``hlat_ckpt.Checkpointer``, whose DCP saves would keep one TP rank's slice of NxD's
    layers. With ``async_save`` a checkpoint is committed when the next save begins."""
    from hlat_ckpt.neuron import NeuronCheckpointer

    return NeuronCheckpointer(**neuron_checkpointer_kwargs(config, dims))


def neuron_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over vocabulary-parallel ``logits`` ``[B, S, V / tp]`` with
    NxD's ``parallel_cross_entropy``, ignoring labels equal to ``hlat_data.IGNORE_INDEX``
    (as ``hlat_model.cross_entropy_loss`` does on the torch backend)."""
    from hlat_data import IGNORE_INDEX
    from hlat_parallel.neuron_backend import parallel_cross_entropy

    return parallel_cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)


def neuron_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor, extracting: bool) -> bool:
    """Step NxD's ZeRO-1 unless ``skip`` (the spike guard's device verdict: a non-finite
    loss under every policy, a spike too under ``skip`` and ``rollback``); return whether the
    update was dropped.

    ZeRO-1 takes no skip flag, so the verdict is read on the host before the step. It is
    read even while ``neuron_parallel_compile`` collects graphs (``extracting``: the read
    ends a graph as it will in the run), but nothing read then is acted on.
    """
    skipped = bool(skip) and not extracting
    if not skipped:
        optimizer.step()
    return skipped


def neuron_grad_norm(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The global gradient norm (before clipping) ZeRO-1 computed in the last
    ``optimizer.step()``, a 0-d tensor on the device (read its value on logging steps only:
    it waits for the step); ``None`` before the first step."""
    from hlat_parallel.neuron_backend import zero1_grad_norm

    return zero1_grad_norm(optimizer)
