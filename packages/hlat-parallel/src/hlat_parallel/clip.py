"""`clip_grad_norm_` and `param_norm`: global L2 norms of tensors split over TP and DP shards."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from hlat_parallel.dims import ParallelDims


def _square_and_groups(
    param: torch.Tensor, grad: torch.Tensor, dims: ParallelDims | None
) -> tuple[torch.Tensor, tuple]:
    """This rank's sum of squares of ``grad`` and the groups over which to sum it."""
    if isinstance(grad, DTensor):
        if any(isinstance(p, Partial) for p in grad.placements):
            grad = grad.redistribute(
                placements=[Replicate() if isinstance(p, Partial) else p for p in grad.placements]
            )
        mesh = grad.device_mesh
        groups = tuple(
            mesh.get_group(i) for i, p in enumerate(grad.placements) if not p.is_replicate()
        )
        return _square(grad.to_local()), groups
    # NeuronX Distributed marks the parameters it splits over TP with this attribute.
    if dims is not None and dims.tp > 1 and getattr(param, "tensor_model_parallel", False):
        return _square(grad), (dims.tp_group,)
    return _square(grad), ()


def _square(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().pow(2).sum()


@torch.no_grad()
def global_norm(
    params: Iterable[torch.Tensor],
    tensors: Iterable[torch.Tensor],
    dims: ParallelDims | None = None,
) -> torch.Tensor:
    """The L2 norm over ``tensors`` (each laid out like the parameter beside it in
    ``params``: the parameter itself, or its gradient), complete on every rank, as a 0-d
    fp32 tensor on the device. Nothing is read on the host.

    Tensors of other pipeline stages (``dims.pp > 1``) are summed over "pp".
    Sharded tensors (DTensors split over "tp" and/or "dp", or NxD tensor-parallel ones
    whose parameter is marked ``tensor_model_parallel``) contribute the sum of their shards'
    squares over the ranks that hold the shards; replicated ones count once.

    Note: ``torch.nn.utils.clip_grad_norm_`` cannot mix DTensors on different meshes (2-D
    TP+FSDP weights next to 1-D FSDP-only norm weights); summing squares per group of
    ranks does, with at most one all-reduce per distinct group.
    """
    totals: dict[tuple, torch.Tensor] = {}
    for param, tensor in zip(params, tensors, strict=True):
        square, groups = _square_and_groups(param, tensor, dims)
        totals[groups] = totals[groups] + square if groups in totals else square
    device = dims.device if dims is not None else None
    total = torch.zeros((), dtype=torch.float32, device=device)
    # Insertion order follows the parameter order, identical on every rank, so the
    # all-reduces below pair up.
    for groups, square in totals.items():
        for group in groups:
            dist.all_reduce(square, group=group)
        total = total.to(square.device) + square
    if dims is not None and dims.pp > 1:
        # each pipeline rank holds other layers: their squares add up over "pp"
        dist.all_reduce(total, group=dims.pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, dims: ParallelDims | None = None
) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; return the
    norm before clipping (a 0-d fp32 tensor on the device, the same on every rank).

    The norm is :func:`global_norm` over the gradients. Gradients of plain data parallelism
    are already averaged across replicas, so they are counted once. Nothing is read on the
    host: a non-finite norm leaves the gradients as they are, and the caller decides on the
    device whether to skip the update (``hlat_optim.AdamW.step(skip=~norm.isfinite())``).
    """
    with_grad = [p for p in params if p.grad is not None]
    norm = global_norm(with_grad, [p.grad for p in with_grad], dims)  # type: ignore[misc]
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    coef = torch.where(norm.isfinite(), coef, torch.ones_like(coef))
    for param in with_grad:
        assert param.grad is not None
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        grad.mul_(coef.to(grad.device, grad.dtype))
    return norm


def param_norm(params: Iterable[torch.Tensor], dims: ParallelDims | None = None) -> torch.Tensor:
    """The global L2 norm of the parameters themselves (:func:`global_norm`), on the device."""
    params = [p.detach() for p in params]
    return global_norm(params, params, dims)
