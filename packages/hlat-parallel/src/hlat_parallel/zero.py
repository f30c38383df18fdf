"""Data parallelism over "dp" with FSDP2 (``dp_shard="fsdp"``, the default), and gradient
accumulation.

Engine: FSDP2's ``fully_shard`` with ``reshard_after_forward=False``. Parameters,
gradients and optimizer state are stored 1/dp per rank; each step all-gathers the
parameters once (forward and backward share the gathered copy), reduce-scatters the
gradients and runs the optimizer on the local 1/dp shard: ZeRO-3 storage with ZeRO-2's
communication (one all-gather and one reduce-scatter per step, the bytes of ZeRO-1's
all-reduce plus all-gather). ZeRO-1 proper (parameters and gradients whole, optimizer state
sharded) is :mod:`hlat_parallel.zero1`.

Note: chosen over ``ZeroRedundancyOptimizer`` because it composes with DTensor TP on the
2-D mesh, overlaps communication with backward, and leaves the optimizer state as DTensors
that ``torch.distributed.checkpoint`` reshards to any other dp or tp size.
``ZeroRedundancyOptimizer`` fails on DTensor parameters (torch 2.13: "Operator
c10d.broadcast_.default does not have a sharding strategy registered"), assigns whole
tensors to ranks, and checkpoints by consolidating all state on one rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hlat_parallel.dims import ParallelConfigError, ParallelDims


def apply_data_parallel(model: nn.Module, dims: ParallelDims) -> None:
    """``fully_shard`` every child of every ``nn.ModuleList`` or ``nn.ModuleDict`` (the
    blocks; a pipeline stage keeps its blocks in a ``ModuleDict``), then the root, over
    :attr:`~hlat_parallel.ParallelDims.dp_cp_mesh` ("dp", or "dp" x "cp" flattened).
    Children are sharded before their ancestors, so a block holding its own list of
    sub-layers is one unit around its sub-units.

    Every data-parallel rank must run the forward of every unit, in the same order (FSDP's
    rule: the ranks' all-gathers are matched by order alone). A module that some ranks may
    skip, such as an MoE expert that gets no tokens on one rank, must not be a unit of its
    own: keep a layer's experts in one module (one unit), as torchtitan does, not in a
    ``ModuleList``. Otherwise ranks pair different experts' all-gathers and compute wrong
    outputs without an error.

    Note: one FSDP unit per block lets the all-gather of block i+1 overlap block i's compute
    and the reduce-scatter of block i overlap block i-1's backward.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = dims.dp_cp_mesh if dims.dp_cp_mesh is not None else dims.dp_mesh
    blocks = [
        block
        for module in model.modules()
        if isinstance(module, (nn.ModuleList, nn.ModuleDict))
        for block in module.children()
    ]
    # modules() lists every ancestor before its descendants: reversed, children come first
    for block in reversed(dict.fromkeys(blocks)):
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


def check_fsdp_parameters(model: nn.Module) -> None:
    """Raise :class:`ParallelConfigError` naming the 0-d parameters of ``model``, which
    FSDP2's ``fully_shard`` cannot shard (it refuses them only once it reaches their
    module, after other units were wrapped). Runs before any module is changed."""
    scalars = [name for name, param in model.named_parameters() if param.dim() == 0]
    if scalars:
        raise ParallelConfigError(
            f"FSDP (dp_shard='fsdp') shards every parameter along a dimension, and "
            f"{', '.join(scalars)} {'is a 0-d parameter' if len(scalars) == 1 else 'are 0-d parameters'}; "
            "parallelize with dp_shard='zero1' (or 'none'), which keep parameters whole, or "
            "make each a 1-element parameter (torch.tensor([value]))"
        )


def _dp_sharded(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    # Under TP x FSDP the dp placement is a _StridedShard, which is not a Shard subclass.
    return any(
        name in ("dp", "dp_cp") and not (placement.is_replicate() or placement.is_partial())
        for name, placement in zip(names, param.placements, strict=False)
    )


def shard_optimizer(
    optimizer_cls: type[torch.optim.Optimizer],
    params: Iterable[Any],
    dims: ParallelDims,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Build ``optimizer_cls(params, **kwargs)`` with its state sharded 1/dp per rank along
    with the parameters (FSDP).

    torch backend: the parameters must come from a model passed to :func:`parallelize`
    with ``dp_shard="fsdp"`` (which shards them over "dp"), so the optimizer creates its
    state on the local shard only; a parameter that is not sharded while dp > 1 is an error
    (ZeRO-1 over whole parameters is :func:`~hlat_parallel.zero1_optimizer`). Any optimizer that
    accepts DTensor parameters works (``torch.optim.AdamW``, ``hlat_optim.AdamW``).
    neuron backend: NeuronX Distributed's ``NeuronZero1Optimizer`` wraps ``optimizer_cls``
    and clips inside ``step()``; ``kw`` must then hold ``optimizer_dtype`` and ``max_norm``
    (``**zero1_precision(mode).zero1_kwargs(), **zero1_clip(max_norm)`` from
    :mod:`hlat_parallel.neuron_backend`; see ``neuron_zero1_optimizer``).
    """
    # A group's "params" may be a generator (weight-decay groups built from
    # named_parameters()); the check below would consume it and leave the group empty.
    params = [_materialised(item) if isinstance(item, dict) else item for item in params]
    if dims.backend == "neuron":
        from hlat_parallel.neuron_backend import neuron_zero1_optimizer

        return neuron_zero1_optimizer(optimizer_cls, params, dims, **kwargs)
    if dims.dp_cp > 1:
        for group_index, group in enumerate(params):
            tensors = group["params"] if isinstance(group, dict) else [group]
            for index, param in enumerate(tensors):
                if not _dp_sharded(param):
                    raise ParallelConfigError(
                        f"parameter {index} of group {group_index} (shape {tuple(param.shape)}) "
                        f"is not sharded over dp x cp {dims.dp_cp}, so its optimizer state would be "
                        "replicated; call parallelize(model, dims, plan) before "
                        "shard_optimizer(..., model.parameters(), dims), or build "
                        "zero1_optimizer for a model parallelized with dp_shard='zero1'"
                    )
    return optimizer_cls(params, **kwargs)


def _materialised(group: dict[str, Any]) -> dict[str, Any]:
    """A copy of parameter ``group`` whose ``params`` is a list (one tensor becomes a
    one-element list, as ``torch.optim.Optimizer.add_param_group`` makes it)."""
    params = group["params"]
    return {**group, "params": [params] if isinstance(params, torch.Tensor) else list(params)}


@contextlib.contextmanager
def no_grad_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally: no data-parallel communication inside the context.

    Run every micro-step but the last under it; the last one, outside, reduces the
    accumulated gradients once. The parameters gathered by the first micro-step are kept
    until the last backward, so later micro-steps do not gather them again.
    A no-op for models without FSDP: tp-only, ``dp_shard="zero1"`` or ``"none"`` (whose
    gradients are reduced once, by :func:`~hlat_parallel.sync_gradients`), or the neuron
    backend (where the optimizer step reduces them).
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
