"""`parallelize`: one plan, applied by the backend ``dims`` was initialised with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from torch import nn

from hlat_parallel.dims import ParallelDims
from hlat_parallel.plan import check_shapes, match_plan

M = TypeVar("M", bound=nn.Module)


def parallelize(model: M, dims: ParallelDims, plan: Mapping[str, Any]) -> M:
    """Apply tensor (and sequence) parallelism from ``plan``, then data parallelism; in place.

    Order, as in torchtitan: TP/SP first, then FSDP2's ``fully_shard`` over "dp" (with "cp"
    when cp > 1; each child of every ``nn.ModuleList`` — the transformer blocks — then the
    root) when dp x cp > 1. A pipeline stage (:class:`~hlat_parallel.StageModule`) is
    parallelized like a whole model: the plan's patterns match its original names. The
    model's own activation checkpointing keeps working: recomputation replays the same
    collectives. On the neuron backend, modules are swapped for NeuronX Distributed layers
    and data parallelism is left to :func:`shard_optimizer`.

    The plan is validated against the model (patterns, layer types, divisibility by tp)
    before anything changes. Returns ``model``.
    """
    matched = match_plan(model, plan)
    check_shapes(model, matched, dims.tp)
    if dims.backend == "neuron":
        from hlat_parallel.neuron_backend import apply_neuron_parallel

        apply_neuron_parallel(model, dims, matched)
        return model
    if dims.tp > 1:
        from hlat_parallel.torch_backend import apply_tensor_parallel

        apply_tensor_parallel(model, dims, matched)
    if dims.dp_cp > 1:
        from hlat_parallel.zero import apply_data_parallel

        apply_data_parallel(model, dims)
    return model
