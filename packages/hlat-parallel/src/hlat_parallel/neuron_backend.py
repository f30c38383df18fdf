"""The plan applied with NeuronX Distributed (NxD) on Trainium.

Modules are swapped for NxD's ``ColumnParallelLinear``, ``RowParallelLinear`` and
``ParallelEmbedding``, loaded with this rank's slice of the original weights. NxD is imported
lazily, inside ``try/except Exception`` (its import needs torch-neuronx, torch-xla and the
Neuron compiler; the PyPI packages of those names are placeholders that raise).

Sequence parallelism follows NxD's layout: between the embedding and the LM head the
activations are sequence-first, ``[S, B, H]``, split along the sequence (dim 0) over the TP
ranks. The embedding all-reduces its vocabulary-parallel lookup and keeps this rank's
sequence slice; each ``ColumnParallelLinear`` all-gathers the sequence of its input (the LM
head too, so logits cover the whole sequence, split over the vocabulary) and each
``RowParallelLinear`` reduce-scatters its output along it. Norm weights, replicated but fed
a slice of the sequence, get partial gradients that are summed over TP. The model itself
must compute sequence-first (``hlat_model.LlamaConfig(sequence_first=True)``).

The translation from plan to NxD constructor arguments, the sequence scatter and the weight
slicing are pure functions (:func:`nxd_layer`, :func:`scatter_sequence`,
:func:`shard_weight`), unit-tested without NxD. The parts that call NxD need a trn1 instance
to verify.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hlat_parallel.dims import ParallelConfigError, ParallelDims
from hlat_parallel.plan import PlanEntry, computes_sequence_first

SEQUENCE_DIM = 0
"""The sequence dimension of activations under NxD sequence parallelism (``[S, B, H]``)."""
EMBEDDING_SEQUENCE_DIM = 1
"""The sequence dimension of the embedding output: token ids come batch-first (``[B, S]``),
so the lookup is ``[B, S, H]``; the model turns it sequence-first itself."""


@dataclass(frozen=True)
class NxdLayer:
    """How one module becomes an NxD layer: class name, constructor keyword arguments, and
    which weight dimension this rank keeps a slice of (``0`` rows, ``1`` columns, ``None``
    the whole weight)."""

    cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    shard_dim: int | None = None
    stride: int = 1
    scatter_output_dim: int | None = None
    """Under sequence parallelism, the output dimension to split over the TP ranks (this
    rank keeps its slice) after the layer has run; ``None``: the output is left as is."""


def nxd_layer(module: nn.Module, entry: PlanEntry, tp: int, sp: bool) -> NxdLayer:
    """The NxD layer for ``module`` under plan ``entry`` (pure; no NxD import).

    ``norm`` keeps the module and only marks its weight ``sequence_parallel_enabled`` (its
    gradient is then summed over TP); ``cls`` is then ``"norm"``.

    Under sequence parallelism (``sp`` and tp > 1) the linear layers get
    ``sequence_parallel_enabled=True`` and ``sequence_dimension=0``: column-parallel ones
    (the LM head included) all-gather the sequence of their input, row-parallel ones
    reduce-scatter their output along it. The embedding keeps NxD's all-reduce and scatters
    its ``[B, S, H]`` output along the sequence (``scatter_output_dim=1``).

    Note: ``fused_colwise`` uses ``stride=1``. The plan's fused layouts repeat whole groups
    (``[q.., k, v]`` per KV head; gate/up interleaved), so a contiguous split gives every
    rank matching slices; Megatron's ``stride`` is for ``[all q; all k; all v]`` layouts.

    Note: the embedding does not use ``ParallelEmbedding``'s own sequence-parallel mode,
    whose reduce-scatter dimension is not configurable in every NxD release; an all-reduce
    and a local slice give the same result for a little more traffic, at this one layer.
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
                "sequence_parallel_enabled": False,
            },
            shard_dim=0,
            scatter_output_dim=EMBEDDING_SEQUENCE_DIM if sp else None,
        )
    assert isinstance(module, nn.Linear)
    bias = module.bias is not None
    sequence: dict[str, Any] = {"sequence_parallel_enabled": sp}
    if sp:
        sequence["sequence_dimension"] = SEQUENCE_DIM
    if entry.style == "rowwise":
        return NxdLayer(
            "RowParallelLinear",
            {
                "input_size": module.in_features,
                "output_size": module.out_features,
                "bias": bias,
                "input_is_parallel": True,
                "dtype": weight.dtype,
                **sequence,
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
            **sequence,
            "stride": 1,
        },
        shard_dim=0,
    )


def scatter_sequence(
    x: torch.Tensor, dim: int, scatter_first_dim: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim``, by ``scatter_first_dim``, which splits
    dimension 0 (NxD's ``scatter_to_sequence_parallel_region``: its backward all-gathers)."""
    if dim == 0:
        return scatter_first_dim(x)
    return scatter_first_dim(x.transpose(0, dim)).transpose(0, dim)


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
    """Swap matched modules for NxD layers holding this rank's weight slices; under
    sequence parallelism also scatter the embedding output, sum norm-weight gradients over
    TP and check at each forward that the sequence splits evenly."""
    if dims.sequence_parallel and not computes_sequence_first(model):
        raise ParallelConfigError(
            "sequence parallelism on the neuron backend needs a model that computes "
            "sequence-first ([seq, batch, hidden] activations, NxD's layout), but "
            f"{type(model).__name__} computes batch-first (no sequence_first=True on the model "
            "or its config); build it with LlamaConfig(sequence_first=True), or set sp=False"
        )
    nxd = _import_nxd()
    layers = nxd.parallel_layers
    modules = dict(model.named_modules())
    for name, entry in matched.items():
        module = modules[name]
        spec = nxd_layer(module, entry, dims.tp, dims.sp)
        if spec.cls == "norm":
            if spec.kwargs["sequence_parallel_enabled"]:
                _sum_grad_over_tp(module.weight)
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
        if spec.scatter_output_dim is not None:
            new.register_forward_hook(_scatter_output(spec.scatter_output_dim, layers.mappings))
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
    if dims.sequence_parallel:
        from hlat_parallel.torch_backend import sequence_check

        model.register_forward_pre_hook(sequence_check(dims.tp), with_kwargs=True)


def _scatter_output(dim: int, mappings: Any) -> Any:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return scatter_sequence(output, dim, mappings.scatter_to_sequence_parallel_region)

    return hook


def _sum_grad_over_tp(weight: torch.Tensor) -> None:
    """Mark ``weight`` ``sequence_parallel_enabled`` and sum each gradient it receives over
    the TP ranks.

    Note: the sum runs in a gradient hook, once per backward, so gradients are complete
    before clipping and the optimizer step (``NeuronZero1Optimizer`` does not sum them;
    NxD's training scripts do it in their loop). A trainer that also calls NxD's
    ``allreduce_sequence_parallel_gradients`` would sum them twice.
    """
    import torch_xla.core.xla_model as xm

    nxd = _import_nxd()
    groups = nxd.parallel_layers.parallel_state.get_tensor_model_parallel_group(as_list=True)
    weight.sequence_parallel_enabled = True  # type: ignore[attr-defined]
    weight.register_hook(lambda grad: xm.all_reduce(xm.REDUCE_SUM, grad, groups=groups))


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
