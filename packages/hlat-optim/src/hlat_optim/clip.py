"""Global L2 norms and gradient clipping for any layout: plain tensors, DTensors (tensor-,
sequence- and data-parallel shards, FSDP2's ``_StridedShard`` under TP), replicas, pipeline
stages, and NeuronX Distributed's plain tensor-parallel shards.

Note: this is hlat's one clipping implementation. It lives in hlat-optim because clipping
belongs to the optimizer step that every trainer runs, and the layout it needs is either in
the tensors themselves (a DTensor's placements say which mesh dimensions hold distinct
shards) or a few process groups the caller passes; so it needs no knowledge of
``hlat_parallel`` (no hlat package imports another, hlat-train aside). hlat-parallel's
``ParallelDims.norm_groups()`` gives those groups for its layouts.

Nothing is read on the host: the norm stays a device tensor, and a non-finite norm leaves
the gradients unscaled so the caller can skip the update on the device
(``AdamW.step(skip=~norm.isfinite())``). ``error_if_nonfinite=True`` opts into one host read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hlat_optim import _native
from hlat_optim.rounding import _is_dtensor, _local

__all__ = ["NonFiniteGradNormError", "clip_coefficient", "clip_grad_norm_", "global_norm"]


class NonFiniteGradNormError(RuntimeError):
    """Raised by ``clip_grad_norm_(..., error_if_nonfinite=True)`` on an inf or NaN norm."""


def nxd_tensor_parallel(param: torch.Tensor) -> bool:
    """NeuronX Distributed marks the parameters its layers split over TP with
    ``tensor_model_parallel = True``; everything else is replicated across TP."""
    return bool(getattr(param, "tensor_model_parallel", False))


_ROW = 1024
"""Elements per row of :func:`_square`'s fp32 partial sums."""


def _square(t: torch.Tensor) -> torch.Tensor:
    """The sum of squares of ``t`` as a 0-d fp32 tensor, in one pass over ``t``.

    Note: the norms of rows of ``_ROW`` elements (one reduction in fp32), then the sum of
    their squares (``sum``'s cascaded reduction); for bf16 CPU tensors the rows' sums of
    squares come from hlat-optim's CPU library in one read (torch's fp32 norm of bf16 rows
    makes an fp32 copy of them first), where it builds. Within about 1e-7 of the float64
    norm on millions of elements (the sum of squares within 4 units in the last place of its
    fp32 result, tested; 2.3e-7 relative at most over 300 inputs of 3 million), where one ``vector_norm(..., dtype=float32)`` over the whole
    tensor drifts by 3e-5 on the CPU (the
    parity tests compare layouts at 1e-5). It replaces a widened copy, its squares and
    their sum (three passes); hlat-optim's benchmark ``test_global_norm_against_torch``
    measures both."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.float64:  # summed in its own precision, then as the others
        return flat.square().sum().float()
    whole = flat.numel() - flat.numel() % _ROW
    # Note: three operators where the tensor is whole rows or shorter than one row (most
    # weights, every norm weight), as many as the three passes it replaced, so launches
    # stay as they were on accelerators.
    if not whole:
        return flat.float().square().sum()
    lib = _bf16_cpu_kernel(flat)
    if lib is not None:
        # Note: torch's CPU norm of bf16 rows in fp32 makes an fp32 copy of them first
        total = _native.bf16_row_sums_of_squares(lib, flat[:whole].view(-1, _ROW)).sum()
    else:
        rows = torch.linalg.vector_norm(flat[:whole].view(-1, _ROW), dim=1, dtype=torch.float32)
        total = rows.square().sum()
    if whole < flat.numel():
        total = total + flat[whole:].float().square().sum()
    return total


def _bf16_cpu_kernel(flat: torch.Tensor) -> Any:
    """hlat-optim's CPU library where it sums the squares of ``flat``'s rows: a plain
    contiguous bf16 CPU tensor, outside code being compiled, the library built."""
    if (
        flat.dtype != torch.bfloat16
        or flat.device.type != "cpu"
        or type(flat) is not torch.Tensor
        or not flat.is_contiguous()
        or torch.compiler.is_compiling()
    ):
        return None
    return _native.load()


def _square_and_groups(
    param: torch.Tensor,
    tensor: torch.Tensor,
    groups: Sequence[Any],
    sharded: Callable[[torch.Tensor], bool],
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """This rank's sum of squares of ``tensor`` and the groups over which it is summed."""
    if _is_dtensor(tensor):
        from torch.distributed.tensor import DTensor, Partial, Replicate

        assert isinstance(tensor, DTensor)
        if any(isinstance(p, Partial) for p in tensor.placements):  # pending reduction
            tensor = tensor.redistribute(
                placements=[Replicate() if isinstance(p, Partial) else p for p in tensor.placements]
            )
        mesh = tensor.device_mesh
        # every placement but Replicate holds distinct elements per rank (Shard and FSDP's
        # _StridedShard alike): their squares add up over that mesh dimension
        held = tuple(
            mesh.get_group(i) for i, p in enumerate(tensor.placements) if not p.is_replicate()
        )
        return _square(tensor.to_local()), held
    return _square(tensor), tuple(groups) if sharded(param) else ()


def _check_groups(fn: str, name: str, groups: Any) -> None:
    """Refuse a ``groups`` or ``stage_groups`` that is not a sequence of process groups."""
    if isinstance(groups, Sequence) and not isinstance(groups, str):
        bad = [g for g in groups if not (dist.is_available() and isinstance(g, dist.ProcessGroup))]
        if not bad:
            return
        got = f"a {type(groups).__name__} holding {bad[0]!r}"
    else:
        got = f"{type(groups).__name__} {groups!r}"
    raise TypeError(
        f"{fn}: {name} must be a sequence of process groups, got {got}; only the L2 norm "
        "is supported (there is no norm_type argument: torch's clip_grad_norm_ takes it "
        "third, this one takes groups)"
    )


@torch.no_grad()
def global_norm(
    params: Iterable[torch.Tensor],
    tensors: Iterable[torch.Tensor | None] | None = None,
    *,
    groups: Sequence[Any] = (),
    stage_groups: Sequence[Any] = (),
    sharded: Callable[[torch.Tensor], bool] = nxd_tensor_parallel,
) -> torch.Tensor:
    """The L2 norm over ``tensors`` (default: ``params`` themselves; or their gradients, each
    laid out like the parameter beside it), complete on every rank, as a 0-d fp32 tensor on
    the tensors' device. A ``None`` in ``tensors`` (a parameter without a gradient) counts
    as no tensor.

    - DTensors add up their shards' squares over the mesh dimensions they are not
      replicated on (one all-reduce per distinct set of groups); replicas count once.
    - Plain tensors whose parameter ``sharded(param)`` says is split (NxD's
      ``tensor_model_parallel`` by default) add up over each process group of ``groups``;
      other plain tensors are whole on every rank and count once.
    - ``stage_groups``: groups whose ranks hold *different* parameters (pipeline stages);
      the totals add up over them.

    Every rank of every group involved must call it, in the same parameter order.

    Note: ``torch.nn.utils.clip_grad_norm_`` cannot mix DTensors on different meshes (2-D
    TP x FSDP weights beside 1-D FSDP-only norm weights); summing squares per group of ranks
    can, with at most one all-reduce per distinct group.
    """
    _check_groups("global_norm", "groups", groups)
    _check_groups("global_norm", "stage_groups", stage_groups)
    params = list(params)
    given: list[torch.Tensor | None] = list(params) if tensors is None else list(tensors)
    if len(given) != len(params):
        raise ValueError(f"global_norm: {len(params)} params but {len(given)} tensors")
    pairs = [(p, t) for p, t in zip(params, given, strict=True) if t is not None]
    device = _local(pairs[0][1]).device if pairs else torch.device("cpu")
    totals: dict[tuple[Any, ...], torch.Tensor] = {}
    for param, tensor in pairs:
        square, held = _square_and_groups(param, tensor, groups, sharded)
        square = square.to(device)
        totals[held] = totals[held] + square if held in totals else square
    total = torch.zeros((), dtype=torch.float32, device=device)
    # insertion order follows the parameter order, the same on every rank, so the
    # all-reduces pair up
    for held, square in totals.items():
        for group in held:
            dist.all_reduce(square, group=group)
        total = total + square
    for group in stage_groups:
        dist.all_reduce(total, group=group)
    return total.sqrt()


@torch.no_grad()
def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The multiplier that :func:`clip_grad_norm_` applies to every gradient, from their
    global norm (:func:`global_norm`): ``min(1, max_norm / (norm + 1e-6))``, and 1 where the
    norm is not finite (the caller skips that update). A 0-d tensor on the norm's device,
    computed there without a host read.

    ``hlat_optim.AdamW.step(clip_coef=...)`` takes it: the step then gives what clipping the
    gradients in place and stepping gives, bit for bit, and on the CPU kernel without the
    pass over the gradients that the in-place multiply makes."""
    if not max_norm > 0:
        raise ValueError(f"clip_coefficient: max_norm must be > 0, got {max_norm}")
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return torch.where(norm.isfinite(), coef, torch.ones_like(coef))


def scale_in_place(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply local gradients in place by ``coef`` in their own dtype (the coefficient
    rounded to it), one call per device and dtype: what :func:`clip_grad_norm_` does to
    them, and ``AdamW.step(clip_coef=...)`` on its paths other than the CPU kernel.

    Note: the same numbers as one ``mul_`` each, in one launch on accelerators, and on CPUs
    2.5x faster in bf16 (a 0-d bf16 operand takes a slow path in ``mul_``: 6.1 against 15.8
    ms for the 34M bf16 gradients of an 8-layer width-512 Llama on a 2-core Xeon with AMX).
    """
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), group in by_kind.items():
        torch._foreach_mul_(group, coef.to(device, dtype))


def clip_grad_norm_(
    params: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    groups: Sequence[Any] = (),
    *,
    stage_groups: Sequence[Any] = (),
    sharded: Callable[[torch.Tensor], bool] = nxd_tensor_parallel,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; return the
    norm before clipping (a 0-d fp32 tensor on the device, the same on every rank).

    The norm is :func:`global_norm` over the gradients (``groups``, ``stage_groups`` and
    ``sharded`` as there; ``hlat_parallel.ParallelDims.norm_groups()`` gives them for its
    layouts). Data-parallel gradients are already averaged across replicas, so they count
    once. A non-finite norm leaves every gradient as it is, without a host read; the
    returned norm lets the caller skip the update (``AdamW.step(skip=~norm.isfinite())``).
    ``error_if_nonfinite=True`` reads the norm on the host and raises
    :class:`NonFiniteGradNormError` naming the local parameters with non-finite gradients.
    ``max_norm = inf`` measures without clipping.

    Only the L2 norm is computed: the third argument is ``groups``, not torch's
    ``norm_type``, and anything but a sequence of process groups there is refused.
    """
    _check_groups("clip_grad_norm_", "groups", groups)
    _check_groups("clip_grad_norm_", "stage_groups", stage_groups)
    if isinstance(params, torch.Tensor):
        params = [params]
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grad]
    norm = global_norm(with_grad, grads, groups=groups, stage_groups=stage_groups, sharded=sharded)
    if error_if_nonfinite and not bool(norm.isfinite()):
        bad = [
            f"#{i} {tuple(p.shape)}"
            for i, p in enumerate(with_grad)
            if not bool(torch.isfinite(_local(p.grad)).all())  # type: ignore[arg-type]
        ]
        where = (
            f"local parameters with non-finite gradients: {', '.join(bad)}"
            if bad
            else "no local gradient is non-finite: the norm overflowed float32, or another "
            "rank holds the bad values"
        )
        raise NonFiniteGradNormError(f"clip_grad_norm_: gradient norm is {norm.item()}; {where}")
    if max_norm == math.inf:  # measuring only: every coefficient would be 1
        return norm
    coef = clip_coefficient(norm, max_norm)
    scale_in_place([_local(grad) for grad in grads], coef)  # type: ignore[arg-type]
    return norm
