"""The plan applied with NeuronX Distributed (NxD) on Trainium (trn1), and NxD's ZeRO-1.

Written against neuronx-distributed 0.18.0 (Neuron SDK 2.29, aws-neuron/neuronx-distributed
at fbac349b61a3adbb123c2983835af692840ff62f) and torch-xla's ``ZeroRedundancyOptimizer``
that its ``NeuronZero1Optimizer`` extends. NxD is imported lazily, inside
``try/except Exception`` (its import needs torch-neuronx, torch-xla and the Neuron
compiler; the PyPI packages of those names are placeholders that raise).

Modules are swapped for NxD's ``ColumnParallelLinear``, ``RowParallelLinear`` and
``ParallelEmbedding``, each built on the XLA device holding only this rank's shard: a copy
of this rank's slice of the original weight, or, for a model built on the meta device,
uninitialised until :func:`init_sharded_weights`.

Sequence parallelism follows NxD's layout: between the embedding and the LM head the
activations are sequence-first, ``[S, B, H]``, split along the sequence (dim 0) over the TP
ranks. The embedding all-reduces its vocabulary-parallel lookup and keeps this rank's
sequence slice; each ``ColumnParallelLinear`` all-gathers the sequence of its input (the LM
head too, so logits cover the whole sequence, split over the vocabulary) and each
``RowParallelLinear`` reduce-scatters its output along it. Norm weights, replicated but fed
a slice of the sequence, get partial gradients that are summed over TP. The model itself
must compute sequence-first (``hlat_model.LlamaConfig(sequence_first=True)``).

Training on this backend: ZeRO-1 computes the global gradient norm and clips inside
``step()`` (:func:`neuron_zero1_optimizer`, :func:`zero1_grad_norm`), with the precision
mode's ``optimizer_dtype`` (:func:`zero1_precision`); the loss is
:func:`parallel_cross_entropy`, which ignores padding labels.

The translation from plan to NxD constructor arguments, the shard arithmetic, the loss
masking, the precision and clip arguments are pure functions, unit-tested without NxD. The
parts that call NxD are unverified on hardware: they need a trn1 instance.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from hlat_parallel.dims import ParallelConfigError, ParallelDims
from hlat_parallel.plan import PlanEntry, check_shared_parameters, computes_sequence_first

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

    ``norm`` keeps the module and, under sequence parallelism, only marks its parameters
    ``sequence_parallel_enabled`` (their gradients are then summed over TP); ``cls`` is then
    ``"norm"``. ``head_norm`` (a norm of each local head) does the same whenever tp > 1.

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
    if entry.style == "head_norm":
        # each rank normalises its own heads: the weight's gradient is partial whenever
        # tp > 1, and is summed over TP like a sequence-parallel norm's
        return NxdLayer("norm", {"sequence_parallel_enabled": tp > 1})
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
                **_embedding_options(module, tp),
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


def _embedding_options(module: nn.Embedding, tp: int) -> dict[str, Any]:
    """The lookup options of ``module`` that differ from ``nn.Embedding``'s defaults, as
    ``ParallelEmbedding`` keyword arguments; those it cannot honour are refused.

    Note: ``ParallelEmbedding`` looks up the tokens outside this rank's vocabulary range at
    its local row 0 and zeroes their output. ``scale_grad_by_freq`` would count them as
    occurrences of that row and scale its gradient down, and ``max_norm`` would renormalise
    that row in place at every lookup, whether or not its own token came: both are refused
    when tp > 1.
    ``sparse`` gradients are refused: NxD's ZeRO-1 and XLA work on dense gradients.
    """
    name = "the embedding"
    if module.sparse:
        raise ParallelConfigError(
            f"{name} has sparse=True; the neuron backend's ParallelEmbedding trains with dense "
            "gradients (NxD's ZeRO-1 and XLA take no sparse ones): build it with sparse=False"
        )
    if module.scale_grad_by_freq and tp > 1:
        raise ParallelConfigError(
            f"{name} has scale_grad_by_freq=True, which NxD's ParallelEmbedding gets wrong at "
            f"tp {tp}: tokens outside a rank's vocabulary range count as occurrences of its "
            "first row, whose gradient is then scaled down; build it with "
            "scale_grad_by_freq=False, or use the torch backend"
        )
    if module.max_norm is not None and tp > 1:
        raise ParallelConfigError(
            f"{name} has max_norm={module.max_norm}, which NxD's ParallelEmbedding gets wrong "
            f"at tp {tp}: tokens outside a rank's vocabulary range are looked up at its first "
            "row, which max_norm then renormalises in place at every step; build it without "
            "max_norm, or use the torch backend"
        )
    options: dict[str, Any] = {}
    if module.padding_idx is not None:
        options["padding_idx"] = module.padding_idx
    if module.max_norm is not None:
        options["max_norm"] = module.max_norm
    if module.norm_type != 2.0:
        options["norm_type"] = module.norm_type
    if module.scale_grad_by_freq:
        options["scale_grad_by_freq"] = True
    return options


def local_padding_idx(
    padding_idx: int | None, num_embeddings: int, tp: int, rank: int
) -> int | None:
    """The row of TP rank ``rank``'s vocabulary shard holding ``padding_idx`` (pure), or
    ``None`` when another rank holds it (contiguous ranges of ``num_embeddings / tp`` rows,
    as ``ParallelEmbedding`` splits the vocabulary).

    Note: ``ParallelEmbedding`` (neuronx-distributed 0.18, Neuron 2.29) tests ``if padding_idx`` and so drops a padding
    index of 0; the layer's local index is set from this function after it is built.
    """
    if padding_idx is None:
        return None
    rows = num_embeddings // tp
    start = rank * rows
    return padding_idx - start if start <= padding_idx < start + rows else None


def scatter_sequence(
    x: torch.Tensor, dim: int, scatter_first_dim: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim``, by ``scatter_first_dim``, which splits
    dimension 0 (NxD's ``scatter_to_sequence_parallel_region``: its backward all-gathers)."""
    if dim == 0:
        return scatter_first_dim(x)
    return scatter_first_dim(x.transpose(0, dim)).transpose(0, dim)


@dataclass(frozen=True)
class LocalShard:
    """What one TP rank holds of a weight: its local ``shape`` and, along ``dim``, the
    ``(start, stop)`` ranges of the whole weight it holds, in order (``dim`` ``None``: the
    whole weight, replicated)."""

    shape: tuple[int, ...]
    dim: int | None
    ranges: tuple[tuple[int, int], ...]


def local_shard(
    shape: Sequence[int], dim: int | None, tp: int, rank: int, stride: int = 1
) -> LocalShard:
    """The slice of a weight of ``shape`` that TP rank ``rank`` of ``tp`` holds (pure).

    With ``stride`` s the dimension is read as s equal parts, each split ``tp`` ways, and the
    rank holds its piece of every part (Megatron's strided partition). This is the layout of
    NxD's ``create_local_weight`` (pieces of ``size / (tp * s)`` rows, rank r taking pieces
    r, r + tp, ...) and of ``ParallelEmbedding``'s contiguous vocabulary ranges.
    """
    shape = tuple(int(n) for n in shape)
    if not 0 <= rank < tp:
        raise ParallelConfigError(f"TP rank {rank} is outside 0..{tp - 1}")
    if dim is None:
        return LocalShard(shape, None, ())
    size = shape[dim]
    if size % (tp * stride):
        raise ParallelConfigError(
            f"cannot split a dimension of {size} into {tp} ranks x stride {stride}"
        )
    piece = size // (tp * stride)
    ranges = tuple(
        ((part * tp + rank) * piece, (part * tp + rank + 1) * piece) for part in range(stride)
    )
    local = list(shape)
    local[dim] = piece * stride
    return LocalShard(tuple(local), dim, ranges)


def shard_weight(
    weight: torch.Tensor, dim: int | None, tp: int, rank: int, stride: int = 1
) -> torch.Tensor:
    """This rank's slice of ``weight`` along ``dim`` (a copy; see :func:`local_shard`)."""
    shard = local_shard(weight.shape, dim, tp, rank, stride)
    source = weight.detach()
    if shard.dim is None:
        return source.clone()
    pieces = [source.narrow(shard.dim, start, stop - start) for start, stop in shard.ranges]
    return torch.cat(pieces, dim=shard.dim)


def shard_init(
    source: torch.Tensor, dim: int | None, tp: int, rank: int, stride: int = 1
) -> Callable[[torch.Tensor], None]:
    """The ``init_method`` to give an NxD layer so that it starts from ``source``'s values.

    NxD calls it with this rank's shard when the layer is built on the XLA device, or with
    the whole weight (an fp32 "master" that NxD then slices itself) when it is built on the
    CPU; the returned function copies this rank's slice, or all of ``source``, accordingly.
    A meta ``source`` has no values: the function then leaves the tensor as NxD allocated it,
    for the model's own initialisation after materialisation (see
    :func:`init_sharded_weights`).

    Note: NxD hands over the layer's Parameter itself, which requires grad, so the copy
    runs under ``no_grad`` (an in-place write to a leaf that requires grad is an error).
    """
    if source.is_meta:
        return lambda tensor: None
    mine = local_shard(source.shape, dim, tp, rank, stride)

    @torch.no_grad()
    def init(tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) == tuple(source.shape):
            tensor.copy_(source.detach())
        elif tuple(tensor.shape) == mine.shape:
            tensor.copy_(shard_weight(source, dim, tp, rank, stride))
        else:
            raise ParallelConfigError(
                f"NxD asked to initialise a tensor of shape {tuple(tensor.shape)} from a "
                f"weight of shape {tuple(source.shape)}, of which TP rank {rank} of {tp} holds "
                f"{mine.shape}; the plan does not describe this layer's split"
            )

    return init


def check_untied(model: nn.Module, matched: Mapping[str, PlanEntry]) -> None:
    """Refuse weights shared between modules the neuron backend swaps (tied input and
    output embeddings), or between a swapped module and one outside it: each NxD layer owns
    its weight, so a tie would silently break.

    Reads ``tie_embeddings`` from the model or its ``config`` (as ``hlat_model.LlamaConfig``
    has) and compares the swapped modules' weights by identity.
    """
    for owner in (model, getattr(model, "config", None)):
        if getattr(owner, "tie_embeddings", False) is True:
            raise ParallelConfigError(
                f"{type(model).__name__} ties its input and output embeddings "
                "(tie_embeddings=True), which the neuron backend cannot split: NxD's "
                "ParallelEmbedding and ColumnParallelLinear each own their weight; build the "
                "model with tie_embeddings=False, or use the torch backend"
            )
    modules = dict(model.named_modules())
    owners: dict[int, str] = {}
    for name, entry in matched.items():
        weight = getattr(modules[name], "weight", None)
        if entry.style in ("norm", "head_norm") or not isinstance(weight, torch.Tensor):
            continue
        other = owners.setdefault(id(weight), name)
        if other != name:
            raise ParallelConfigError(
                f"{other} and {name} share one weight (tied embeddings?), which the neuron "
                "backend cannot split: NxD's parallel layers each own their weight; untie "
                "them (for hlat_model: LlamaConfig(tie_embeddings=False)) or use the torch "
                "backend"
            )
    swapped = [n for n, entry in matched.items() if entry.style not in ("norm", "head_norm")]
    check_shared_parameters(
        model,
        swapped,
        "the neuron backend swaps the planned module for an NxD layer that owns its weight, "
        "which would silently untie them; untie the weights or use the torch backend",
    )


class NxdUnavailableError(ParallelConfigError, RuntimeError):
    """The neuron backend was asked for where NeuronX Distributed cannot be imported: a
    :class:`~hlat_parallel.ParallelConfigError`, and a ``RuntimeError`` as it was before."""


def _import_nxd() -> Any:
    try:
        import neuronx_distributed
    except Exception as error:  # the placeholder packages raise on import
        raise NxdUnavailableError(
            "the neuron backend needs NeuronX Distributed from the Neuron repository "
            "(pip install neuronx-distributed torch-neuronx --extra-index-url "
            "https://pip.repos.neuron.amazonaws.com) on a Trainium instance; "
            f"importing it failed: {error}"
        ) from error
    return neuronx_distributed


def init_neuron_parallel(
    world_size: int, rank: int, tp: int, sp: bool, timeout: datetime.timedelta | None
) -> ParallelDims:
    """XLA process group + NxD ``initialize_model_parallel`` (PP 1). NxD chooses the TP
    groups (on trn1 not always contiguous ranks: TP 4 takes ranks 8 apart, within a node);
    every rank and group hlat uses is NxD's."""
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
    """Swap matched modules for NxD layers holding only this rank's shards; under sequence
    parallelism also scatter the embedding output, sum over TP the gradients of the
    parameters each rank computes from its part of the sequence only
    (:func:`sequence_parallel_params`) and check at each forward that the sequence splits
    evenly.

    Every NxD layer is built on ``dims.device`` (the XLA device on trn1) with its
    ``device``, ``dtype`` and ``init_method`` arguments, so each rank allocates its own
    shards there and nothing else. When the model's weights are real, ``init_method`` copies
    this rank's slice of them (:func:`shard_init`); when the model is on the meta device
    (built under ``torch.device("meta")``), the shards are left uninitialised: materialise
    the rest with ``model.to_empty(device=dims.device)`` and initialise everything with
    :func:`init_sharded_weights`.

    Note: the layers are built on the device rather than on meta because ``to_empty``
    replaces meta parameters by new Parameter objects, which would drop the
    ``tensor_model_parallel`` attributes NxD sets on its weights (ZeRO-1's gradient norm
    and NxD's checkpoints read them); parameters already on the device keep their objects.
    Tied embeddings are refused (:func:`check_untied`).
    """
    if dims.sequence_parallel and not computes_sequence_first(model):
        raise ParallelConfigError(
            "sequence parallelism on the neuron backend needs a model that computes "
            "sequence-first ([seq, batch, hidden] activations, NxD's layout), but "
            f"{type(model).__name__} computes batch-first (no sequence_first=True on the model "
            "or its config); build it with LlamaConfig(sequence_first=True), or set sp=False"
        )
    check_untied(model, matched)
    nxd = _import_nxd()
    layers = nxd.parallel_layers
    _ensure_model_parallel_rng(layers, dims)
    modules = dict(model.named_modules())
    for name, entry in matched.items():
        module = modules[name]
        spec = nxd_layer(module, entry, dims.tp, dims.sp)
        if spec.cls == "norm":
            if spec.kwargs["sequence_parallel_enabled"]:
                module.register_forward_pre_hook(_sum_grad_over_tp)
                _sum_grad_over_tp(module, ())
            continue
        init = shard_init(module.weight, spec.shard_dim, dims.tp, dims.tp_rank, spec.stride)
        new = getattr(layers, spec.cls)(**spec.kwargs, device=dims.device, init_method=init)
        bias = getattr(module, "bias", None)
        if bias is not None and not bias.is_meta:
            # Note: NxD gives a bias its own uniform init, whatever init_method says
            dim = 0 if spec.shard_dim == 0 else None
            shard_init(bias, dim, dims.tp, dims.tp_rank)(new.bias)
        if spec.cls == "ParallelEmbedding" and "padding_idx" in spec.kwargs:
            new.padding_idx = local_padding_idx(
                spec.kwargs["padding_idx"], spec.kwargs["num_embeddings"], dims.tp, dims.tp_rank
            )
        new._hlat_nxd_layer = True  # see check_nxd_attributes
        if dims.sequence_parallel and sequence_parallel_params(new):
            new.register_forward_pre_hook(_sum_grad_over_tp)
            _sum_grad_over_tp(new, ())
        if spec.scatter_output_dim is not None:
            new.register_forward_hook(_scatter_output(spec.scatter_output_dim, layers.mappings))
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
    if dims.sequence_parallel:
        from hlat_parallel.torch_backend import sequence_check

        model.register_forward_pre_hook(sequence_check(dims.tp), with_kwargs=True)


MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The name of NxD's per-TP-rank RNG state (``parallel_layers.random``)."""


def _ensure_model_parallel_rng(layers: Any, dims: ParallelDims) -> None:
    """Give NxD's RNG tracker its per-TP-rank state if nobody has yet.

    Note: NxD builds a layer on the XLA device inside ``get_xla_rng_tracker().fork()``,
    which raises until ``model_parallel_xla_manual_seed`` has run. The values drawn there do
    not matter here (:func:`shard_init` copies or leaves the shard), so the state is added
    with the tracker's own ``add``, which restores the torch generator, rather than with
    ``model_parallel_xla_manual_seed``, which reseeds it; a later
    ``model_parallel_xla_manual_seed(seed)`` replaces it.
    """
    tracker = layers.get_xla_rng_tracker()
    if MODEL_PARALLEL_RNG not in tracker.get_states():
        tracker.add(MODEL_PARALLEL_RNG, tp_seed(0, dims.tp_rank))


def _scatter_output(dim: int, mappings: Any) -> Any:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return scatter_sequence(output, dim, mappings.scatter_to_sequence_parallel_region)

    return hook


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module`` whose gradients are partial sums over TP under sequence
    parallelism (each rank computes them from its part of the sequence): on an NxD layer
    swapped in by :func:`apply_neuron_parallel`, those NxD tags ``sequence_parallel_enabled``
    (a row-parallel bias); on any other module (a norm), all of them."""
    if getattr(module, "_hlat_nxd_layer", False):
        return [p for p in module.parameters() if getattr(p, "sequence_parallel_enabled", False)]
    return list(module.parameters())


def _sum_grad_over_tp(module: nn.Module, args: tuple) -> None:
    """Mark each of :func:`sequence_parallel_params` of ``module``
    ``sequence_parallel_enabled`` and sum each gradient it receives over the TP ranks (a
    forward pre-hook; idempotent: one hook per parameter).

    Note: the sum runs in a gradient hook, once per backward, so gradients are complete
    before ZeRO-1's clipping and step (``NeuronZero1Optimizer`` does not sum them; NxD's
    training scripts do it in their loop). A trainer that also calls NxD's
    ``allreduce_sequence_parallel_gradients`` would sum them twice. It is (re)attached at
    each forward, not once: ``model.to_empty`` replaces a meta norm weight by a new
    Parameter, which carries neither the attribute nor the hook.
    """
    params: list[Any] = [
        p for p in sequence_parallel_params(module) if not getattr(p, "_hlat_tp_grad_sum", False)
    ]
    if not params:
        return
    import torch_xla.core.xla_model as xm

    nxd = _import_nxd()
    groups = nxd.parallel_layers.parallel_state.get_tensor_model_parallel_group(as_list=True)
    for param in params:
        param.sequence_parallel_enabled = True
        param.register_hook(lambda grad: xm.all_reduce(xm.REDUCE_SUM, grad, groups=groups))
        param._hlat_tp_grad_sum = True


def check_nxd_attributes(model: nn.Module) -> None:
    """Raise unless every weight of an NxD layer swapped in by :func:`apply_neuron_parallel`
    still carries NxD's ``tensor_model_parallel`` attribute.

    NxD's ZeRO-1 gradient norm counts a weight without it as replicated over TP (and
    :func:`init_sharded_weights` would make its shards equal), so a lost attribute means a
    silently wrong clip; it is lost when a meta parameter is materialised as a new object.
    """
    for name, module in model.named_modules():
        if getattr(module, "_hlat_nxd_layer", False) and not getattr(
            module.weight, "tensor_model_parallel", False
        ):
            raise ParallelConfigError(
                f"{name}.weight lost NxD's tensor_model_parallel attribute (its parameter "
                "was replaced, e.g. by to_empty() from the meta device onto another device "
                "than the one parallelize() built it on); materialise the model with "
                "model.to_empty(device=dims.device)"
            )


def tp_seed(seed: int, tp_rank: int) -> int:
    """The RNG seed of TP rank ``tp_rank`` for initialising split weights: NxD's
    ``model_parallel_xla_manual_seed`` convention (``seed + 2718 + tp_rank``), the same on
    every data-parallel replica."""
    return seed + 2718 + tp_rank


def _seed_all(seed: int, device: torch.device) -> None:
    torch.manual_seed(seed)
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed, device=device)


@torch.no_grad()
def init_sharded_weights(
    model: nn.Module,
    dims: ParallelDims,
    seed: int,
    init: Callable[[], None] | None = None,
) -> None:
    """Initialise a model whose weights are split over TP (default: ``model.init_weights()``).

    ``init`` runs with the RNG seeded per TP rank (:func:`tp_seed`), so that each rank draws
    different values for its shards of a split weight (``nn.init.normal_`` on a local shard
    draws from the local generator; with one seed on every rank all shards would be equal),
    while data-parallel replicas draw the same. Every parameter that is not split
    (no ``tensor_model_parallel`` attribute: norms, row-parallel biases) is then made equal
    over the TP group to TP rank 0's values, and the RNG is reseeded with ``seed``.

    Note: values depend on the TP degree (each rank draws its own shard), unlike NxD's CPU
    path, which draws every whole weight on every rank and slices it: that would hold a
    whole layer per rank, which the meta path exists to avoid.
    """
    import torch.distributed as dist

    check_nxd_attributes(model)
    run: Any = init if init is not None else model.init_weights
    _seed_all(tp_seed(seed, dims.tp_rank), dims.device)
    try:
        run()
    finally:
        _seed_all(seed, dims.device)
    if dims.tp == 1:
        return
    keep = 1.0 if dims.tp_rank == 0 else 0.0
    for param in model.parameters():
        if not getattr(param, "tensor_model_parallel", False):
            # Note: a masked all-reduce is a broadcast from TP rank 0 (x + 0 + ... is exact)
            # with the one collective every backend, XLA's included, implements.
            param.mul_(keep)
            dist.all_reduce(param, group=dims.tp_group)


def masked_token_mean(
    per_token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean of ``per_token_loss(logits, labels)`` over the labels that are not
    ``ignore_index`` (pure): what ``F.cross_entropy(..., ignore_index=ignore_index)`` computes.

    ``per_token_loss`` never sees ``ignore_index``: those positions get label 0, a valid
    class, and are masked out after, so a loss that indexes the vocabulary with the labels
    stays in range. Masked positions get a zero gradient. Without any valid label the
    result is 0 (``F.cross_entropy`` gives NaN).

    Note: multiplying by a mask instead of selecting the valid positions keeps every shape
    static, which XLA needs to reuse one compiled graph.
    """
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    loss = per_token_loss(logits, safe)
    weight = valid.to(loss.dtype)
    return (loss * weight).sum() / weight.sum().clamp(min=1)


def parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean next-token loss over vocabulary-parallel logits with NxD's
    ``parallel_cross_entropy``, over the labels that are not ``ignore_index`` (as the torch
    backend's ``F.cross_entropy`` does; see :func:`masked_token_mean`).

    Note: NxD's function overwrites its input; logits that are already fp32 are that input.
    """
    nxd = _import_nxd()
    per_token = nxd.parallel_layers.loss_functions.parallel_cross_entropy
    return masked_token_mean(
        lambda x, target: per_token(x.float(), target), logits, labels, ignore_index
    )


PRECISIONS = ("bf16-sr", "bf16", "bf16-kahan", "mixed", "fp32")
"""The precision modes of the project, on every backend."""


@dataclass(frozen=True)
class Zero1Precision:
    """How a precision mode runs on NxD's ZeRO-1 (see :func:`zero1_precision`)."""

    mode: str
    param_dtype: torch.dtype
    """The dtype to cast the model to."""
    optimizer_dtype: torch.dtype
    """ZeRO-1's ``optimizer_dtype``: the dtype of its weight shards (the master weights)
    and so of AdamW's moments."""
    fp32_grad_accumulation: bool
    """ZeRO-1's ``use_grad_acc_hook`` and ``higher_cc_precision``: gradients accumulated
    and reduce-scattered in ``optimizer_dtype`` (NxD's ``use_fp32_grad_acc``)."""
    save_master_weights: bool
    """ZeRO-1's ``save_master_weights``: checkpoints keep the fp32 master shards, so a
    resumed run continues from them rather than from the rounded bf16 weights."""
    stochastic_rounding: bool
    """The hardware switch ``NEURON_RT_STOCHASTIC_ROUNDING_EN``."""
    description: str
    """One line saying what runs."""

    def zero1_kwargs(self) -> dict[str, Any]:
        """The precision arguments of ``NeuronZero1Optimizer``."""
        return {
            "optimizer_dtype": self.optimizer_dtype,
            "use_grad_acc_hook": self.fp32_grad_accumulation,
            "higher_cc_precision": self.fp32_grad_accumulation,
            "save_master_weights": self.save_master_weights,
        }


def zero1_precision(mode: str) -> Zero1Precision:
    """The NxD ZeRO-1 settings of a precision mode (pure).

    ``optimizer_dtype`` must follow the mode: ZeRO-1 keeps its weight shards, and AdamW its
    moments, in it (``torch.float32`` when not given), and writes the updated shards back
    into the model's parameters cast to their dtype.

    - ``bf16-sr`` (HLAT's recipe): bf16 weights, gradients, shards and moments (6 bytes of
      optimizer state per parameter, sharded over DP; no fp32 copy anywhere), with the
      hardware's stochastic rounding on every bf16 result.
    - ``bf16``: the same with round-to-nearest (the mode that diverged in HLAT's study).
    - ``mixed``: bf16 weights and compute, fp32 master shards and moments (12 bytes per
      parameter over DP), gradients accumulated and reduce-scattered in fp32, master shards
      saved in checkpoints (NxD's ``use_master_weights``, ``use_fp32_grad_acc`` and
      ``use_master_weights_in_ckpt``); round-to-nearest.
    - ``fp32``: fp32 everywhere; round-to-nearest.
    - ``bf16-kahan`` is refused: NxD's ZeRO-1 has no Kahan-compensated update, and
      hlat-optim's runs on CPU and CUDA (a C++ loop, or ``torch.compile``), not on XLA.
    """
    bf16, fp32 = torch.bfloat16, torch.float32
    if mode == "bf16-sr":
        return Zero1Precision(
            mode, bf16, bf16, False, False, True,
            "bf16-sr: bf16 weights, gradients and AdamW moments (ZeRO-1 optimizer_dtype "
            "bfloat16, no fp32 master copy), hardware stochastic rounding "
            "(NEURON_RT_STOCHASTIC_ROUNDING_EN=1)",
        )  # fmt: skip
    if mode == "bf16":
        return Zero1Precision(
            mode, bf16, bf16, False, False, False,
            "bf16: bf16 weights, gradients and AdamW moments (ZeRO-1 optimizer_dtype "
            "bfloat16), round-to-nearest (NEURON_RT_STOCHASTIC_ROUNDING_EN=0)",
        )  # fmt: skip
    if mode == "mixed":
        return Zero1Precision(
            mode, bf16, fp32, True, True, False,
            "mixed: bf16 weights and compute, fp32 master weights and AdamW moments in "
            "ZeRO-1 (optimizer_dtype float32), fp32 gradient accumulation and "
            "reduce-scatter, master weights saved in checkpoints, round-to-nearest",
        )  # fmt: skip
    if mode == "fp32":
        return Zero1Precision(
            mode, fp32, fp32, False, False, False,
            "fp32: fp32 weights, gradients and AdamW moments (ZeRO-1 optimizer_dtype "
            "float32), round-to-nearest",
        )  # fmt: skip
    if mode == "bf16-kahan":
        raise ParallelConfigError(
            "precision bf16-kahan is not available on the neuron backend: NxD's ZeRO-1 "
            "optimizer has no Kahan-compensated update and hlat-optim's runs on CPU and CUDA, "
            "not XLA; use bf16-sr (bf16 with the hardware's stochastic rounding, as HLAT "
            "trained) or mixed (fp32 master weights)"
        )
    raise ParallelConfigError(
        f"unknown precision {mode!r}; the neuron backend runs {', '.join(PRECISIONS[:2])}, "
        "mixed and fp32"
    )


def zero1_clip(max_norm: float) -> dict[str, Any]:
    """ZeRO-1's clipping arguments for a global gradient-norm clip at ``max_norm``
    (0 or less: no clipping).

    Clipping is always on, so that ZeRO-1 computes the gradient norm every step (it does
    so only to clip); "no clipping" is a clip at infinity, whose coefficient is 1.
    ``max_norm`` is always passed: ZeRO-1's own default is 1.0, whatever the caller's
    configuration says.
    """
    return {"grad_clipping": True, "max_norm": float(max_norm) if max_norm > 0 else math.inf}


ZERO1_BUCKET_CAP_MB = 130
"""Bucket size of ZeRO-1's coalesced reduce-scatter (the all-gather's is this over dp):
NxD's trainer's figure (it reports NaNs above 140 MB)."""


def neuron_zero1_optimizer(
    optimizer_cls: type[torch.optim.Optimizer],
    params: list[Any],
    dims: ParallelDims,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """NxD's ``NeuronZero1Optimizer`` wrapping ``optimizer_cls``: weight shards and
    optimizer states split over DP, gradients reduce-scattered over DP, one global gradient
    norm over TP and DP computed and clipped inside ``step()`` (read it afterwards with
    :func:`zero1_grad_norm`; do not clip before ``step()``).

    ``kwargs`` must name ``optimizer_dtype`` (see :func:`zero1_precision`) and, unless
    ``grad_clipping=False``, ``max_norm`` (see :func:`zero1_clip`): ZeRO-1's defaults (fp32
    shards, a clip at 1.0) would otherwise apply without a word. The rest go to
    ``optimizer_cls``.
    """
    if "optimizer_dtype" not in kwargs:
        raise ParallelConfigError(
            "shard_optimizer on the neuron backend needs optimizer_dtype= (NxD's ZeRO-1 "
            "keeps its weight shards and the optimizer states in it, fp32 by default); pass "
            "**zero1_precision(precision).zero1_kwargs()"
        )
    if kwargs.get("grad_clipping", True) and "max_norm" not in kwargs:
        raise ParallelConfigError(
            "shard_optimizer on the neuron backend clips inside NxD's ZeRO-1 and needs "
            "max_norm= (its default is 1.0 whatever the configuration says); pass "
            "**zero1_clip(max_norm)"
        )
    nxd = _import_nxd()
    from neuronx_distributed.optimizer import NeuronZero1Optimizer

    state = nxd.parallel_layers.parallel_state
    kwargs.setdefault("bucket_cap_mb_reduce_scatter", ZERO1_BUCKET_CAP_MB)
    kwargs.setdefault("bucket_cap_mb_all_gather", max(1, ZERO1_BUCKET_CAP_MB // dims.dp))
    return NeuronZero1Optimizer(
        params,
        optimizer_cls,
        pin_layout=False,
        sharding_groups=state.get_data_parallel_group(as_list=True),
        grad_norm_groups=state.get_tensor_model_parallel_group(as_list=True),
        **kwargs,
    )


def zero1_grad_norm(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The global gradient norm (before clipping) that NxD's ZeRO-1 computed in its last
    ``step()``: its ``grad_norm`` property, a 0-d tensor on the device (reading its value
    waits for the step); ``None`` before the first step. NxD sums the squares in the dtype
    of the weight shards (``optimizer_dtype``: bf16 under ``bf16-sr``).

    Raises :class:`TypeError` for an optimizer without that property (not NxD's ZeRO-1).
    """
    if not hasattr(type(optimizer), "grad_norm"):
        raise TypeError(
            f"{type(optimizer).__name__} has no grad_norm; on the neuron backend build the "
            "optimizer with shard_optimizer (NxD's NeuronZero1Optimizer), which computes the "
            "gradient norm while clipping"
        )
    return cast(Any, optimizer).grad_norm
