"""`parallelize`: one plan, applied by the backend ``dims`` was initialised with."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from hlat_parallel.dims import ParallelDims
from hlat_parallel.plan import check_sequence_parallel, check_shapes, match_plan

M = TypeVar("M", bound=nn.Module)


def compile_blocks(model: nn.Module, **options: Any) -> int:
    """``torch.compile`` each child of every ``nn.ModuleList`` or ``nn.ModuleDict`` (the
    transformer blocks), in place (``Module.compile``: parameter names do not change); the
    number of modules compiled. Apply tensor parallelism first, as :func:`parallelize` does.

    The model's ``loss_fn(logits, labels)``, where it has one (``hlat_model.Llama``'s), is
    compiled too, as torchtitan compiles its loss beside its blocks: for plain-tensor
    logits; vocabulary-sharded ones (DTensors, tensor parallelism's loss) keep the eager
    function. A ``loss_fn`` that is an ``nn.Module`` (``nn.CrossEntropyLoss()``) is left as
    it is.

    Note: on a 2-core AVX512-BF16 CPU, bf16, the benchmarks' Llama (width 512, 8 layers, 4 x
    512 tokens), with the blocks compiled, compiling the loss too took the step from 1,187
    to 1,169 ms (fastest of 6 steps alternating in one process; an ad-hoc script). In
    hlat-model's benchmark (``test_compiled_blocks_against_eager``) compiled blocks ran
    1.034x eager, and with the loss 1.072x in a later run the same day. The eager loss
    (``hlat_model.cross_entropy_loss``) converts the bf16 logits to fp32 chunk by chunk
    and makes a pass over each chunk per operation; inductor fuses those.

    Note: blocks of one model share their code, so the first compiled block's graph serves
    the others; ``options`` go to ``torch.compile`` (e.g. ``backend="neuron"``).

    Note: under tensor parallelism (a model with DTensor parameters when this runs), every
    module outside the blocks gets a forward hook that turns an ``AsyncCollectiveTensor`` it
    returns into a plain tensor (a copy, which waits for the collective, recorded by
    autograd); without it no module is hooked. Tensor parallelism leaves one where a module's output
    is reduced asynchronously and handed on as a local tensor (``RowwiseParallel`` on the
    embedding). A compiled block that takes one returns a plain tensor as its gradient where
    the reduction's backward needs a DTensor, and the backward fails with "'Tensor' object
    has no attribute '_local_tensor'" (torch 2.13, any backend through AOT autograd).
    """
    blocks: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            for child in module.children():
                child.compile(**options)
                blocks.append(child)
    loss_fn = getattr(model, "loss_fn", None)
    # a loss held as a submodule (``self.loss_fn = nn.CrossEntropyLoss()``) is registered in
    # the module tree, where a plain function cannot replace it: it is left eager
    compilable = callable(loss_fn) and not isinstance(loss_fn, nn.Module)
    if loss_fn is not None and compilable and not getattr(loss_fn, "hlat_compiled", False):
        setattr(model, "loss_fn", _compiled_loss(loss_fn, **options))  # noqa: B010
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed: no collectives to wait for
        return len(blocks)
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        # no tensor parallelism, nothing hands on an AsyncCollectiveTensor: no hooks, so an
        # unhooked head stays one (hlat_model.Llama fuses its head and loss only then)
        return len(blocks)

    def wait_async_output(module: nn.Module, args: Any, output: Any) -> Any:
        return output.clone() if isinstance(output, AsyncCollectiveTensor) else None

    inside = {id(m) for block in blocks for m in block.modules()}
    for module in model.modules():
        if id(module) not in inside:
            module.register_forward_hook(wait_async_output)
    return len(blocks)


def _compiled_loss(loss_fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``loss_fn`` through ``torch.compile`` for plain-tensor logits, itself for others
    (tensor subclasses: vocabulary-sharded DTensors under ``loss_parallel``)."""
    compiled = torch.compile(loss_fn, **options)

    @functools.wraps(loss_fn)
    def loss(logits: Any, *args: Any, **kwargs: Any) -> Any:
        if type(logits) is torch.Tensor:
            return compiled(logits, *args, **kwargs)
        return loss_fn(logits, *args, **kwargs)

    loss.hlat_compiled = True  # type: ignore[attr-defined]
    return loss


#: Data-parallel layouts of :func:`parallelize`.
DP_SHARD = ("fsdp", "zero1", "none")


def resolve_dp_shard(dp_shard: str | None, backend: str) -> str:
    """The data-parallel layout ``dp_shard`` names on ``backend`` (pure): ``None`` or
    ``"auto"`` is ``"fsdp"`` on the torch backend and ``"zero1"`` on the neuron backend,
    whose only layout is NxD's ZeRO-1; an unknown name is a ``ValueError``."""
    if dp_shard in (None, "auto"):
        return "zero1" if backend == "neuron" else "fsdp"
    if dp_shard not in DP_SHARD:
        raise ValueError(f"dp_shard must be one of {DP_SHARD}, got {dp_shard!r}")
    return dp_shard


def parallelize(
    model: M,
    dims: ParallelDims,
    plan: Mapping[str, Any],
    *,
    compile: bool = False,
    dp_shard: str | None = None,
) -> M:
    """Apply tensor (and sequence) parallelism from ``plan``, then data parallelism; in place.

    Order, as in torchtitan: TP/SP first, then, with ``compile``, ``torch.compile`` of each
    transformer block (:func:`compile_blocks`; backend ``neuron`` on TorchNeuron's device),
    then FSDP2's ``fully_shard`` over "dp" (with "cp" when cp > 1; each child of every
    ``nn.ModuleList`` — the transformer blocks — then the root) when dp x cp > 1, so that
    FSDP's all-gathers stay outside the compiled graphs.

    ``dp_shard`` picks the data-parallel layout: ``"fsdp"`` (parameters, gradients and
    optimizer state sharded; optimizer from :func:`shard_optimizer`), ``"zero1"``
    (parameters and gradients whole, optimizer state sharded; :func:`zero1_optimizer`) or
    ``"none"`` (everything whole; any optimizer). Under the last two the model is left
    whole over "dp": average its gradients with :func:`sync_gradients` before clipping.
    ``None``: ``"fsdp"`` on the torch backend, ``"zero1"`` on the neuron backend, whose
    only layout is NxD's ZeRO-1. A pipeline stage (:class:`~hlat_parallel.StageModule`) is
    parallelized like a whole model: the plan's patterns match its original names. The
    model's own activation checkpointing keeps working: recomputation replays the same
    collectives. On the neuron backend, modules are swapped for NeuronX Distributed layers
    and data parallelism is left to :func:`shard_optimizer`.

    The plan is validated against the model (patterns, layer types, divisibility by tp;
    under sequence parallelism, that it matches every module holding parameters of its own)
    before anything changes. Returns ``model``.
    """
    dp_shard = resolve_dp_shard(dp_shard, dims.backend)
    if dims.backend == "neuron" and dp_shard != "zero1" and dims.dp > 1:
        raise ValueError(
            f"parallelize: dp_shard={dp_shard!r} is not available on the neuron backend, whose "
            "data parallelism is NeuronX Distributed's ZeRO-1; use dp_shard='zero1'"
        )
    matched = match_plan(model, plan)
    check_shapes(model, matched, dims.tp)
    if dims.sequence_parallel:
        check_sequence_parallel(model, matched)
    fsdp = dims.backend == "torch" and dims.dp_cp > 1 and dp_shard == "fsdp"
    if fsdp:
        from hlat_parallel.zero import check_fsdp_parameters

        check_fsdp_parameters(model)
    if dims.backend == "neuron":
        if compile:
            raise ValueError(
                "parallelize(compile=True): the NeuronX Distributed backend (trn1) compiles "
                "the whole step through XLA; block compilation is for the torch backend"
            )
        from hlat_parallel.neuron_backend import apply_neuron_parallel

        apply_neuron_parallel(model, dims, matched)
        return model
    if dims.tp > 1:
        from hlat_parallel.torch_backend import apply_tensor_parallel

        apply_tensor_parallel(model, dims, matched)
    if compile:
        from hlat_parallel.device import compile_backend_for

        compile_blocks(model, backend=compile_backend_for(dims.device))
    if fsdp:
        from hlat_parallel.zero import apply_data_parallel

        apply_data_parallel(model, dims)
    return model
