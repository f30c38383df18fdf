"""Global gradient-norm clipping across plain tensors, DTensors and process groups."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hlat_optim.rounding import _is_dtensor, _local

__all__ = ["NonFiniteGradNormError", "clip_grad_norm_"]


class NonFiniteGradNormError(RuntimeError):
    """Raised by ``clip_grad_norm_(..., error_if_nonfinite=True)`` on an inf or NaN norm."""


def _sq_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, 2, dtype=torch.float32).square()


def _dtensor_sq_norms(grads: list[Any], device: torch.device) -> torch.Tensor:
    """Sum of squared norms of DTensor gradients, complete on every rank.

    Shards of one placement layout are summed locally and all-reduced once over the mesh
    dimensions they are sharded on; replicated dimensions are not reduced, so a replicated
    gradient is counted once.
    """
    from torch.distributed.tensor import Replicate, Shard

    total = torch.zeros((), dtype=torch.float32, device=device)
    layouts: dict[tuple[Any, tuple[Any, ...]], list[torch.Tensor]] = {}
    for g in grads:
        if all(isinstance(pl, (Shard, Replicate)) for pl in g.placements):
            layouts.setdefault((g.device_mesh, tuple(g.placements)), []).append(g.to_local())
        else:
            # Partial (pending-reduction) gradients: let DTensor finish the norm itself.
            total = (
                total + torch.linalg.vector_norm(g, 2, dtype=torch.float32).full_tensor().square()
            )
    for (mesh, placements), locals_ in layouts.items():
        sq = torch.stack([_sq_norm(t) for t in locals_]).sum().to(device)
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                dist.all_reduce(sq, group=mesh.get_group(mesh_dim))
        total = total + sq
    return total


def clip_grad_norm_(
    params: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    groups: Sequence[dist.ProcessGroup] | None = None,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale gradients in place so that their global L2 norm is at most ``max_norm``;
    return the norm before clipping (a float32 0-d tensor).

    The norm covers every gradient of ``params``: plain tensors, whose squared norm is
    summed over each process group in ``groups`` (the groups the plain gradients are
    sharded over, e.g. the tensor-parallel group of NxD-style layers), and DTensors, whose
    norm is computed over their global tensor from the local shards (one all-reduce per
    placement layout, never a gather of gradients). Every rank of ``groups`` must call it.

    If the norm is inf or NaN the gradients are left untouched, a ``RuntimeWarning`` names
    the problem, and the returned norm lets the caller skip the step
    (``if not norm.isfinite(): optimizer.zero_grad(); continue``); with
    ``error_if_nonfinite=True`` a ``NonFiniteGradNormError`` naming the offending local
    parameters is raised instead.

    Note: checking finiteness reads the norm on the host, one device sync per call; a
    trainer that logs the norm every step pays it anyway.
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    grads = [p.grad for p in params if p.grad is not None]
    plain = [g for g in grads if not _is_dtensor(g)]
    dtensors = [g for g in grads if _is_dtensor(g)]
    if grads:
        device = _local(grads[0]).device
    elif params:
        device = params[0].device
    else:
        device = torch.device("cpu")

    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    if plain:
        total_sq = torch.stack([_sq_norm(g).to(device) for g in plain]).sum()
    for group in groups or ():
        # Called even with no local gradients: every member must join the collective.
        dist.all_reduce(total_sq, group=group)
    if dtensors:
        total_sq = total_sq + _dtensor_sq_norms(dtensors, device)
    total = total_sq.sqrt()

    if not bool(torch.isfinite(total)):
        bad = [
            f"#{i} {tuple(p.shape)}"
            for i, p in enumerate(params)
            if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())
        ]
        where = (
            f"local parameters with non-finite gradients: {', '.join(bad)}"
            if bad
            else (
                "no local gradient is non-finite, so the norm overflowed float32 or another rank "
                "holds the bad values"
            )
        )
        message = f"clip_grad_norm_: gradient norm is {total.item()}; {where}"
        if error_if_nonfinite:
            raise NonFiniteGradNormError(message)
        warnings.warn(
            message + "; gradients left unscaled, skip this step", RuntimeWarning, stacklevel=2
        )
        return total

    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = _local(g)
        local.mul_(coef.to(local.device, local.dtype))
    return total
