"""The plan applied with DTensor: ``parallelize_module`` styles on the "tp" mesh.

Without sequence parallelism activations between blocks are replicated on every TP rank;
with it they are split along the sequence (dim 1, or dim 0 for models computing
sequence-first) and each colwise layer all-gathers the
sequence on the way in, each rowwise layer reduce-scatters it on the way out (Megatron-LM's
layout). The LM head leaves its logits split over the vocabulary as a DTensor, so the loss
must be computed under :func:`loss_parallel`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hlat_parallel.dims import ParallelConfigError, ParallelDims
from hlat_parallel.plan import PlanEntry, check_shared_parameters, computes_sequence_first


def torch_styles(
    matched: Mapping[str, PlanEntry], sp: bool, sequence_dim: int = 1
) -> dict[str, ParallelStyle]:
    """DTensor parallel styles for matched modules (``name -> entry``).

    Under ``sp`` the activations entering colwise layers and leaving rowwise layers are
    sequence-sharded (``Shard(sequence_dim)``: 1 for ``[B, S, H]`` activations, 0 for
    models computing sequence-first); norms run on sequence shards (``SequenceParallel``).
    The embedding output is ``[B, S, H]`` either way (token ids come batch-first), so it is
    sharded along dimension 1. Without SP norms are left alone: their input is replicated,
    so is their weight. A ``head_norm`` runs on the local heads between a colwise and a
    rowwise layer, with or without SP: its weight is replicated and its gradient summed
    over tp.

    Note: ``fused_colwise`` becomes a plain ``ColwiseParallel``: the plan's fused layouts
    are TP-independent, so a contiguous row split gives each rank whole groups (checked
    beforehand by ``check_shapes``).
    """
    seq: Any = Shard(sequence_dim) if sp else Replicate()
    embedded: Any = Shard(1) if sp else Replicate()
    styles: dict[str, ParallelStyle] = {}
    for name, entry in matched.items():
        if entry.style in ("colwise", "fused_colwise"):
            styles[name] = ColwiseParallel(input_layouts=seq)
        elif entry.style == "rowwise":
            styles[name] = RowwiseParallel(output_layouts=seq)
        elif entry.style == "embedding":
            # Vocabulary rows are sharded; each rank looks up its rows and the partial sums
            # are reduced (all-reduce, or reduce-scatter over the sequence under SP).
            styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=embedded)
        elif entry.style == "lm_head":
            styles[name] = ColwiseParallel(
                input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
            )
        elif entry.style == "norm" and sp:
            styles[name] = SequenceParallel(sequence_dim=sequence_dim)
        elif entry.style == "head_norm":
            # The input is this rank's heads, a colwise layer's local output, with or without
            # SP: read as sharded over the heads dimension, the replicated weight's gradient
            # comes out Partial and is summed over tp (align_grad_placements, FSDP or
            # sync_gradients), as torchtitan's Qwen3 plan does for q_norm and k_norm.
            styles[name] = SequenceParallel(sequence_dim=entry.heads_dim, use_local_output=True)
    return styles


def apply_tensor_parallel(
    model: nn.Module, dims: ParallelDims, matched: Mapping[str, PlanEntry]
) -> None:
    """Split ``model`` in place over ``dims.tp_mesh`` following the matched plan entries."""
    modules = dict(model.named_modules())
    embeddings = [n for n, e in matched.items() if e.style == "embedding"]
    heads = [n for n, e in matched.items() if e.style == "lm_head"]
    for head in heads:
        for emb in embeddings:
            if modules[head].weight is modules[emb].weight:
                raise ParallelConfigError(
                    f"{head} shares its weight with {emb} (tied embeddings); tensor parallelism "
                    "needs them untied (e.g. LlamaConfig(tie_embeddings=False))"
                )
    sequence_dim = 0 if computes_sequence_first(model) else 1
    styles = torch_styles(matched, dims.sequence_parallel, sequence_dim)
    check_shared_parameters(
        model,
        list(styles),
        "tensor parallelism replaces the planned module's parameters with DTensors, which "
        "would silently untie them; untie the weights (e.g. "
        "LlamaConfig(tie_embeddings=False)) or leave the module out of the plan",
    )
    parallelize_module(model, dims.tp_mesh, styles)
    if dims.dp_cp == 1:  # FSDP2 aligns the gradients itself when it is applied on top
        align_grad_placements(model)
    # Note: only a module taking token ids is checked: a later pipeline stage (a
    # StageModule whose split is not the first) takes the hidden state, already split.
    split = getattr(model, "split", None)
    if dims.sequence_parallel and (split is None or getattr(split, "first", True)):
        model.register_forward_pre_hook(sequence_check(dims.tp), with_kwargs=True)


def align_grad_placements(model: nn.Module) -> None:
    """Make every DTensor parameter's gradient share its parameter's placements, once it is
    accumulated.

    Note: DTensor's autograd leaves some gradients in another layout than their parameter:
    the vocab-parallel embedding's as ``Replicate`` (the full [vocab, dim] gradient on every
    rank), sequence-parallel norm weights' as ``Partial`` (not yet summed over TP).
    Optimizers that work on local shards (``hlat_optim.AdamW``, fused kernels) need the
    gradient shard to match the parameter shard; the redistribution slices the former (no
    communication) and all-reduces the latter (a few KB per norm).

    Note: the hooks live on the parameter objects' autograd state, which
    ``module.to_empty()`` replaces (meta-device initialisation after :func:`parallelize`),
    and they cannot be registered again on the swapped parameters. ``hlat_optim.AdamW``
    (0.2+) realigns such gradients itself; other local-shard optimizers need a model
    parallelized after it is materialised.
    """

    def align(param: torch.Tensor) -> None:
        grad = param.grad
        if not (isinstance(grad, DTensor) and isinstance(param, DTensor)):
            return
        if tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)

    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(align)


def sequence_check(tp: int) -> Any:
    """A forward pre-hook refusing token ids ``[B, S]`` whose S does not split over tp."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, torch.Tensor) and first.dim() >= 2 and first.shape[1] % tp:
            raise ParallelConfigError(
                f"sequence parallelism splits the sequence over tp {tp} ranks, but "
                f"{type(module).__name__} got a sequence of {first.shape[1]} tokens; feed a "
                f"multiple of {tp} or set sp=False"
            )

    return hook


@contextlib.contextmanager
def loss_parallel(dims: ParallelDims) -> Iterator[None]:
    """Context for the loss and its backward when the LM head is vocab-parallel.

    Under it ``F.cross_entropy`` on vocabulary-sharded logits computes the softmax with
    two small all-reduces instead of gathering [batch, seq, vocab] logits. ``backward()``
    must run inside the context too. A no-op when tp is 1 and on the neuron backend, so that
    a trainer can enter it on every backend: there NxD's logits at tp > 1 are this rank's
    vocabulary shard as a plain tensor, which ``F.cross_entropy`` would take for the whole
    vocabulary, so compute the loss with
    :func:`hlat_parallel.neuron_backend.parallel_cross_entropy` (``hlat_model.Llama`` swapped
    by ``parallelize`` does).
    """
    if dims.backend == "torch" and dims.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel as _loss_parallel

        with _loss_parallel():
            yield
    else:
        yield
