"""The plan applied with NeuronX Distributed (NxD) on Trainium.

Modules are swapped for NxD's ``ColumnParallelLinear``, ``RowParallelLinear`` and
``ParallelEmbedding``, loaded with this rank's slice of the original weights. NxD is imported
lazily, inside ``try/except Exception`` (its import needs torch-neuronx, torch-xla and the
Neuron compiler; the PyPI packages of those names are placeholders that raise).

The translation from plan to NxD constructor arguments and the weight slicing are pure
functions (:func:`nxd_layer`, :func:`shard_weight`), unit-tested without NxD. The parts that
call NxD need a trn1 instance to verify.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hlat_parallel.dims import ParallelConfigError, ParallelDims
from hlat_parallel.plan import PlanEntry


@dataclass(frozen=True)
class NxdLayer:
    """How one module becomes an NxD layer: class name, constructor keyword arguments, and
    which weight dimension this rank keeps a slice of (``0`` rows, ``1`` columns, ``None``
    the whole weight)."""

    cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    shard_dim: int | None = None
    stride: int = 1


def nxd_layer(module: nn.Module, entry: PlanEntry, tp: int, sp: bool) -> NxdLayer:
    """The NxD layer for ``module`` under plan ``entry`` (pure; no NxD import).

    ``norm`` keeps the module and only marks its weight ``sequence_parallel_enabled`` (NxD
    all-reduces such gradients over TP); ``cls`` is then ``"norm"``.

    Note: ``fused_colwise`` uses ``stride=1``. The plan's fused layouts repeat whole groups
    (``[q.., k, v]`` per KV head; gate/up interleaved), so a contiguous split gives every
    rank matching slices; Megatron's ``stride`` is for ``[all q; all k; all v]`` layouts.
    """
    sp = sp and tp > 1
    if entry.style == "norm":
        return NxdLayer("norm", {"sequence_parallel_enabled": sp})
    weight = module.weight
    if entry.style == "embedding":
        assert isinstance(module, nn.Embedding)
        return NxdLayer(
            "ParallelEmbedding",
            {
                "num_embeddings": module.num_embeddings,
                "embedding_dim": module.embedding_dim,
                "dtype": weight.dtype,
                "sequence_parallel_enabled": sp,
            },
            shard_dim=0,
        )
    assert isinstance(module, nn.Linear)
    bias = module.bias is not None
    if entry.style == "rowwise":
        return NxdLayer(
            "RowParallelLinear",
            {
                "input_size": module.in_features,
                "output_size": module.out_features,
                "bias": bias,
                "input_is_parallel": True,
                "dtype": weight.dtype,
                "sequence_parallel_enabled": sp,
            },
            shard_dim=1,
        )
    return NxdLayer(
        "ColumnParallelLinear",
        {
            "input_size": module.in_features,
            "output_size": module.out_features,
            "bias": bias,
            "gather_output": False,  # the LM head too: logits stay vocab-parallel
            "dtype": weight.dtype,
            "sequence_parallel_enabled": sp,
            "stride": 1,
        },
        shard_dim=0,
    )


def shard_weight(
    weight: torch.Tensor, dim: int | None, tp: int, rank: int, stride: int = 1
) -> torch.Tensor:
    """This rank's slice of ``weight`` along ``dim`` (a copy).

    With ``stride`` s the dimension is read as s equal parts, each split ``tp`` ways, and
    the rank keeps its piece of every part (Megatron's strided partition).
    """
    if dim is None:
        return weight.detach().clone()
    size = weight.shape[dim]
    if size % (tp * stride):
        raise ParallelConfigError(
            f"cannot split a dimension of {size} into {tp} ranks x stride {stride}"
        )
    pieces = weight.detach().chunk(tp * stride, dim=dim)
    return torch.cat([pieces[part * tp + rank] for part in range(stride)], dim=dim).clone()


def _import_nxd() -> Any:
    try:
        import neuronx_distributed
    except Exception as error:  # the placeholder packages raise on import
        raise RuntimeError(
            "the neuron backend needs NeuronX Distributed from the Neuron repository "
            "(pip install hlat-parallel[neuron] --extra-index-url "
            "https://pip.repos.neuron.amazonaws.com) on a Trainium instance; "
            f"importing it failed: {error}"
        ) from error
    return neuronx_distributed


def init_neuron_parallel(
    world_size: int, rank: int, tp: int, sp: bool, timeout: datetime.timedelta | None
) -> ParallelDims:
    """XLA process group + NxD ``initialize_model_parallel`` (TP contiguous, PP 1)."""
    import torch.distributed as dist

    nxd = _import_nxd()
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)

    if not dist.is_initialized():
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group("xla", init_method="xla://", **kwargs)
    state = nxd.parallel_layers.parallel_state
    state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    return ParallelDims(
        world_size=world_size,
        rank=rank,
        tp=tp,
        dp=world_size // tp,
        sp=sp,
        backend="neuron",
        device=xm.xla_device(),
        tp_rank=state.get_tensor_model_parallel_rank(),
        dp_rank=state.get_data_parallel_rank(),
        tp_group=state.get_tensor_model_parallel_group(),
        dp_group=state.get_data_parallel_group(),
    )


def apply_neuron_parallel(
    model: nn.Module, dims: ParallelDims, matched: Mapping[str, PlanEntry]
) -> None:
    """Swap matched modules for NxD layers holding this rank's weight slices."""
    if dims.sequence_parallel:
        raise ParallelConfigError(
            "NxD sequence parallelism splits dimension 0 of the activations ([seq, batch, "
            "hidden]); models computing batch-first ([batch, seq, hidden]) need sp=False on "
            "the neuron backend"
        )
    nxd = _import_nxd()
    layers = nxd.parallel_layers
    modules = dict(model.named_modules())
    for name, entry in matched.items():
        module = modules[name]
        spec = nxd_layer(module, entry, dims.tp, dims.sp)
        if spec.cls == "norm":
            module.weight.sequence_parallel_enabled = spec.kwargs["sequence_parallel_enabled"]
            continue
        new = getattr(layers, spec.cls)(**spec.kwargs)
        with torch.no_grad():
            new.weight.copy_(
                shard_weight(module.weight, spec.shard_dim, dims.tp, dims.tp_rank, spec.stride)
            )
            bias = getattr(module, "bias", None)
            if bias is not None:
                dim = 0 if spec.shard_dim == 0 else None
                new.bias.copy_(shard_weight(bias, dim, dims.tp, dims.tp_rank))
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)


def parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over vocabulary-parallel logits with NxD's
    ``parallel_cross_entropy`` (which overwrites ``logits``)."""
    nxd = _import_nxd()
    loss = nxd.parallel_layers.loss_functions.parallel_cross_entropy(logits.float(), labels)
    return loss.mean()


def neuron_zero1_optimizer(
    optimizer_cls: type[torch.optim.Optimizer],
    params: list[Any],
    dims: ParallelDims,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """NxD's ``NeuronZero1Optimizer`` wrapping ``optimizer_cls``: states sharded over DP,
    gradient norm computed over TP."""
    nxd = _import_nxd()
    from neuronx_distributed.optimizer import NeuronZero1Optimizer

    state = nxd.parallel_layers.parallel_state
    return NeuronZero1Optimizer(
        params,
        optimizer_cls,
        pin_layout=False,
        sharding_groups=state.get_data_parallel_group(as_list=True),
        grad_norm_groups=state.get_tensor_model_parallel_group(as_list=True),
        **kwargs,
    )
