"""`clip_grad_norm_`: the global L2 norm of gradients split over TP shards and DP shards."""

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
def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, dims: ParallelDims | None = None
) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; return the
    norm before clipping (a plain 0-d fp32 tensor, the same on every rank).

    Sharded gradients (DTensors split over "tp" and/or "dp", or NxD tensor-parallel
    gradients marked ``tensor_model_parallel``) contribute the sum of their shards' squares
    over the ranks that hold the shards; replicated ones count once. Gradients of plain
    data parallelism are already averaged across replicas, so they are counted once too.

    Note: ``torch.nn.utils.clip_grad_norm_`` cannot mix DTensors on different meshes (2-D
    TP+FSDP weights next to 1-D FSDP-only norm weights); summing squares per group of
    ranks does, with at most one all-reduce per distinct group.
    """
    with_grad = [p for p in params if p.grad is not None]
    totals: dict[tuple, torch.Tensor] = {}
    for param in with_grad:
        assert param.grad is not None
        square, groups = _square_and_groups(param, param.grad, dims)
        totals[groups] = totals[groups] + square if groups in totals else square
    total = torch.zeros((), dtype=torch.float32)
    # Insertion order follows the parameter order, identical on every rank, so the
    # all-reduces below pair up.
    for groups, square in totals.items():
        for group in groups:
            dist.all_reduce(square, group=group)
        total = total.to(square.device) + square
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in with_grad:
        assert param.grad is not None
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        grad.mul_(coef.to(grad.device, grad.dtype))
    return norm
