"""ZeRO-1 and plain data parallelism: parameters and gradients whole on every data-parallel
rank, optimizer state sharded 1/dp (ZeRO-1) or whole (``dp_shard="none"``).

The step, on each rank:

1. :func:`sync_gradients` averages the accumulated gradients over "dp" (with "cp", when
   cp > 1) with bucketed all-reduces, so every rank holds the whole averaged gradient
   (clipping can then read it, as it would without data parallelism);
2. :class:`Zero1Optimizer` copies this rank's 1/dp slice of every parameter out of the
   model and runs the wrapped optimizer on it (its state exists for that slice only);
3. and all-gathers the updated slices into the whole parameters.

The slices are cut from the parameters anew at every step, so the step always updates the
model's current weights: those a checkpoint (a resume, a rollback) or any other in-place
change wrote into the model after the optimizer was built. State the wrapped optimizer
keeps of its own (``hlat_optim.AdamW``'s fp32 master weights, Kahan compensations) comes
from its ``load_state_dict``, as without ZeRO-1.

Note: each slice is a ``DTensor`` sharded over "dp" (and, under TP, laid out over "tp" as
its parameter is), so the optimizer state it creates is a DTensor whose global shape is the
parameter's: ``torch.distributed.checkpoint`` saves it once and loads it into any other
layout (FSDP, another dp or tp). The slice is cut along the first dimension that TP does
not shard (dim 0 of a row-parallel weight or a norm, dim 1 of a column-parallel one), which
keeps it a regular DTensor. A parameter with no dimension left to cut (a 0-d parameter, or
a 1-D one TP shards on dim 0, such as a column-parallel bias) keeps whole state on every
rank: each rank steps all of it with the same averaged gradient, as ``dp_shard="none"``
does, and writes it back without an all-gather.

Note: written beside FSDP2 rather than with ``ZeroRedundancyOptimizer``, which fails on
DTensor parameters, assigns whole tensors to ranks and checkpoints by gathering all state
on one rank; and rather than DDP, which renames parameters (``module.``), does not take
DTensor (TP) parameters and would reduce each micro-batch under a pipeline schedule. The
gradient all-reduce runs after the backward (not overlapped with it), once per step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from hlat_parallel.dims import ParallelConfigError, ParallelDims
from hlat_parallel.zero import _dp_sharded

#: Bytes per all-reduce or all-gather bucket.
BUCKET_BYTES = 64 << 20

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _buckets(tensors: list[torch.Tensor], limit: int) -> Iterator[list[int]]:
    """Indices of ``tensors`` in runs of one dtype and at most ``limit`` bytes (a larger
    tensor makes a run of its own)."""
    run: list[int] = []
    size = 0
    for index, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if run and (tensors[run[0]].dtype != t.dtype or size + nbytes > limit):
            yield run
            run, size = [], 0
        run.append(index)
        size += nbytes
    if run:
        yield run


def _dp_rank_and_group(dims: ParallelDims) -> tuple[int, Any]:
    if dims.cp == 1:
        return dims.dp_rank, dims.dp_group
    return dims.dp_cp_mesh.get_local_rank(), dims.dp_cp_group


@torch.no_grad()
def sync_gradients(model: nn.Module, dims: ParallelDims) -> None:
    """Average the gradients of ``model``'s whole (not dp-sharded) parameters over the
    data-parallel ranks (dp x cp), in place: the reduction of ``dp_shard="zero1"`` and
    ``"none"``. Call it once per step, after the last micro-batch's backward and before
    clipping; a no-op for FSDP's sharded parameters (reduced during backward), for dp x cp
    of 1 and on the neuron backend (NxD's ZeRO-1 reduces inside ``step()``).

    Every parameter that requires grad takes part on every rank, so the ranks reduce
    buffers of one layout even when a parameter got no gradient on some of them (an expert
    no token of this rank's batch was routed to). As in DDP, a missing gradient counts as
    zeros in the sum, which is divided by dp x cp; a parameter that got no gradient on any
    rank keeps ``grad = None``, so optimizers skip it as they would in one process.

    Note: each parameter adds one element to the reduced buffer (the bucket's markers, at
    its end), 1 on the ranks that hold its gradient: the sum tells every rank whether any
    had one, without another collective. A rank reads those sums on the host only for the
    parameters it has no gradient of (one copy per bucket that holds any), so a step where
    every rank has every gradient reads nothing from the device. Gradients are summed in
    their own dtype.

    Note: a DTensor gradient left in another layout than its parameter (a sequence-parallel
    norm weight's ``Partial``) is redistributed to the parameter's first, so the all-reduce
    sums like with like.
    """
    if dims.backend == "neuron" or dims.dp_cp == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad and not _dp_sharded(p)]
    if not params:
        return
    grads: list[torch.Tensor | None] = []
    for param in params:
        p: Any = param
        grad: Any = p.grad
        mismatched = isinstance(grad, DTensor) and isinstance(p, DTensor)
        if mismatched and tuple(grad.placements) != tuple(p.placements):
            grad = grad.redistribute(p.device_mesh, p.placements)
            p.grad = grad
        grads.append(None if grad is None else _local(grad))
    # the layout of the buffers, the same on every rank whichever gradients this rank holds:
    # the parameters' local sizes, in the dtype each gradient has (its parameter's
    # grad_dtype), then one marker per parameter
    dtypes = [_grad_dtype(p) for p in params]
    sizes = [
        torch.empty(_local(p).numel() + 1, dtype=d, device="meta")
        for p, d in zip(params, dtypes, strict=True)
    ]
    _, group = _dp_rank_and_group(dims)
    pending = []
    for run in _buckets(sizes, BUCKET_BYTES):
        dtype, device = dtypes[run[0]], _local(params[run[0]]).device
        pieces = []
        for i in run:
            grad, local = grads[i], _local(params[i])
            if grad is None:
                pieces.append(torch.zeros(local.numel(), dtype=dtype, device=device))
            else:
                pieces.append(grad.reshape(-1).to(dtype))
        held = [grads[i] is not None for i in run]
        # 1 where this rank holds the gradient: one fill, or one small copy from the host
        # where some is missing (host to device: nothing waits for the device)
        if all(held):
            pieces.append(torch.ones(len(run), dtype=dtype, device=device))
        else:
            pieces.append(torch.tensor(held, dtype=dtype).to(device))
        flat = torch.cat(pieces)
        pending.append((run, held, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for run, held, flat, work in pending:
        work.wait()
        counted = list(held)  # this rank's own gradient is one
        missing = [k for k, has in enumerate(held) if not has]
        if missing:
            markers = flat[flat.numel() - len(run) :]
            found = (markers[missing] > 0).tolist()  # one device-to-host copy
            for k, any_grad in zip(missing, found, strict=True):
                counted[k] = any_grad
        offset = 0
        for i, any_grad in zip(run, counted, strict=True):
            target: Any = params[i]
            local = _local(target)
            n = local.numel()
            if any_grad:
                mean = flat[offset : offset + n].view_as(local).div_(dims.dp_cp)
                grad = grads[i]
                if grad is not None:
                    grad.copy_(mean)
                elif isinstance(target, DTensor):
                    target.grad = DTensor.from_local(
                        mean.clone(),
                        target.device_mesh,
                        target.placements,
                        run_check=False,
                        shape=target.shape,
                        stride=target.stride(),
                    )
                else:
                    target.grad = mean.clone()
            offset += n


def _grad_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of ``param``'s gradient, the same on every rank whether or not this one has
    it: the parameter's ``grad_dtype`` (its own dtype unless set otherwise); where that is
    ``None`` (any dtype taken), fp32 or wider."""
    declared = getattr(param, "grad_dtype", param.dtype)
    if declared is None:
        return torch.promote_types(param.dtype, torch.float32)
    return declared


class _Slot:
    """One parameter and this rank's slice of it: the dimension cut over dp, the slice's
    range on every dp rank, and the slice as a DTensor parameter the optimizer steps."""

    def __init__(self, param: torch.Tensor, dims: ParallelDims, index: int) -> None:
        if _dp_sharded(param):
            raise ParallelConfigError(
                f"parameter {index} (shape {tuple(param.shape)}) is already sharded over dp "
                "(FSDP, parallelize(..., dp_shard='fsdp')); build its optimizer with "
                "shard_optimizer, or parallelize with dp_shard='zero1'"
            )
        self.param = param
        local = _local(param).detach()
        rank, _ = _dp_rank_and_group(dims)
        n = dims.dp_cp
        tp_dims: set[int] = set()
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            if tuple(names) != ("tp",):
                raise ParallelConfigError(
                    f"parameter {index}: a ZeRO-1 slice is cut from a plain tensor or a "
                    f"DTensor on the 'tp' mesh, not one on {names}"
                )
            tp_dims = {pl.dim for pl in param.placements if isinstance(pl, Shard)}
        free = [d for d in range(local.dim()) if d not in tp_dims]
        self.dim: int | None = free[0] if free else None
        """The dimension cut over dp; None: the slice is the whole (local) parameter."""
        self.rank = rank
        self.chunk_numel = 0
        """Elements of the largest rank's slice: the padded size each rank all-gathers."""
        if self.dim is None:
            self.ranges = [(0, 0)] * n
            piece = local.clone()
            placements: list[Any] = [Replicate()]
        else:
            size = local.shape[self.dim]
            chunk = -(-size // n)
            self.ranges = [(min(r * chunk, size), min(r * chunk + chunk, size)) for r in range(n)]
            lo, hi = self.ranges[rank]
            piece = local.narrow(self.dim, lo, hi - lo).clone()
            placements = [Shard(self.dim)]
            self.chunk_numel = chunk * (local.numel() // size if size else 0)
        if isinstance(param, DTensor):
            mesh = dims.mesh["dp" if dims.cp == 1 else "dp_cp", "tp"]
            placements += list(param.placements)
        else:
            mesh = dims.mesh["dp"] if dims.cp == 1 else dims.dp_cp_mesh
        self.shard = nn.Parameter(
            DTensor.from_local(
                piece, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
            ),
            requires_grad=param.requires_grad,
        )

    def piece_of(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of ``tensor`` (the parameter's local layout)."""
        if self.dim is None:
            return tensor
        lo, hi = self.ranges[rank]
        return tensor.narrow(self.dim, lo, hi - lo)

    def mine(self) -> torch.Tensor:
        """This rank's slice of the parameter as the model holds it now (a view)."""
        return self.piece_of(_local(self.param), self.rank)


class _Group(MutableMapping):
    """A parameter group as the caller sees it: the wrapped optimizer's group (learning
    rate, betas...), with ``params`` naming the model's parameters rather than the slices.

    Note: the group is looked up in the wrapped optimizer at each access, not kept:
    ``Optimizer.load_state_dict`` replaces its group dicts with new ones holding the loaded
    hyper-parameters, and a learning rate a scheduler sets after a load must reach those.
    """

    def __init__(self, owner: Zero1Optimizer, index: int, params: list[torch.Tensor]) -> None:
        self._owner = owner
        self._index = index
        self._params = params

    @property
    def _inner(self) -> dict[str, Any]:
        group: dict[str, Any] = self._owner.inner.param_groups[self._index]
        return group

    def __getitem__(self, key: str) -> Any:
        return self._params if key == "params" else self._inner[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise TypeError("Zero1Optimizer: a parameter group's params cannot be replaced")
        self._inner[key] = value

    def __delitem__(self, key: str) -> None:
        del self._inner[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


class _State(Mapping):
    """The optimizer state keyed by the model's parameters (what
    ``torch.distributed.checkpoint.state_dict`` looks up), held for the slices."""

    def __init__(self, owner: Zero1Optimizer) -> None:
        self._owner = owner

    def _items(self) -> Iterator[tuple[torch.Tensor, Any]]:
        state = self._owner.inner.state
        for slot in self._owner._slots:
            if slot.shard in state:
                yield slot.param, state[slot.shard]

    def __getitem__(self, param: torch.Tensor) -> Any:
        slot = self._owner._slot_of.get(id(param))
        state = self._owner.inner.state
        if slot is None or slot.shard not in state:
            raise KeyError("parameter has no optimizer state")
        return state[slot.shard]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (key for key, _ in self._items())

    def __len__(self) -> int:
        return sum(1 for _ in self._items())


class Zero1Optimizer(torch.optim.Optimizer):
    """ZeRO-1: ``optimizer_cls`` over this rank's 1/dp slice of every parameter, then an
    all-gather of the updated slices into the whole parameters (see the module's notes).

    Build it with :func:`zero1_optimizer`. It behaves as the wrapped optimizer to a
    trainer: ``param_groups`` (learning-rate schedulers set ``lr`` there) lists the model's
    parameters, ``step(**kwargs)`` passes ``kwargs`` on (``skip=`` of
    ``hlat_optim.AdamW``), ``state_dict()`` is the wrapped optimizer's, whose tensors
    are DTensors with their parameters' global shapes, and hooks registered on it run as
    on any torch optimizer. Gradients must be averaged first
    (:func:`sync_gradients`); the step reads this rank's slice of them, and of the
    parameters as the model holds them then, so weights loaded into the model after the
    optimizer was built (a resumed checkpoint, a rollback) are the ones it updates.
    """

    def __init__(
        self,
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        params: Iterable[Any],
        dims: ParallelDims,
        **kwargs: Any,
    ) -> None:
        items = list(params)
        if not items:
            raise ValueError("Zero1Optimizer got an empty parameter list")
        groups = items if isinstance(items[0], dict) else [{"params": items}]
        self.dims = dims
        self._slots: list[_Slot] = []
        inner_groups = []
        for group in groups:
            shards = []
            for param in group["params"]:
                slot = _Slot(param, dims, len(self._slots))
                self._slots.append(slot)
                shards.append(slot.shard)
            inner_groups.append({**group, "params": shards})
        self._slot_of = {id(slot.param): slot for slot in self._slots}
        self.inner = optimizer_cls(inner_groups, **kwargs)
        # Note: Optimizer.__init__ is not called; the wrapped optimizer owns the groups,
        # defaults and state, and the attributes below are views of them.
        self.defaults = self.inner.defaults
        start = 0
        self._groups: list[_Group] = []
        for index, inner in enumerate(self.inner.param_groups):
            count = len(inner["params"])
            mine = [slot.param for slot in self._slots[start : start + count]]
            self._groups.append(_Group(self, index, mine))
            start += count
        for hooks in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, hooks, OrderedDict())

    @property
    def param_groups(self) -> list[Any]:  # type: ignore[override]
        return self._groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return _State(self)

    def __repr__(self) -> str:
        return f"Zero1Optimizer(dp={self.dims.dp_cp}, {self.inner!r})"

    @torch.no_grad()
    def _slice_gradients(self) -> None:
        rank, _ = _dp_rank_and_group(self.dims)
        for slot in self._slots:
            grad: Any = slot.param.grad
            if grad is None:
                slot.shard.grad = None
                continue
            p: Any = slot.param
            if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
                grad = grad.redistribute(p.device_mesh, p.placements)
            piece = slot.piece_of(_local(grad), rank).contiguous()
            shard: Any = slot.shard
            slot.shard.grad = DTensor.from_local(
                piece.to(shard.dtype),
                shard.device_mesh,
                shard.placements,
                run_check=False,
                shape=shard.shape,
                stride=shard.stride(),
            )

    @torch.no_grad()
    def _refresh(self) -> None:
        """Copy this rank's slice of every trained parameter out of the model into the
        slice the wrapped optimizer steps.

        Note: a step leaves each slice equal to its part of the parameter, so in a run
        that only steps this copies the values the slices already hold; after a load into
        the model (``set_model_state_dict``, ``load_state_dict``, a rollback) it brings the
        loaded weights in, where a slice kept from the previous step would overwrite them
        in :meth:`_gather`. It moves 1/dp of the parameters' bytes in local memory per step.
        """
        for slot in self._slots:
            if slot.param.requires_grad:
                _local(slot.shard).copy_(slot.mine())

    @torch.no_grad()
    def _gather(self) -> None:
        """Write every rank's updated slice into the whole parameters (bucketed
        all-gathers of equal-sized, zero-padded pieces; a whole slice is copied back on
        every rank, which stepped it alike)."""
        _, group = _dp_rank_and_group(self.dims)
        n = self.dims.dp_cp
        trained = [s for s in self._slots if s.param.requires_grad]
        for slot in trained:
            if slot.dim is None:
                _local(slot.param).copy_(_local(slot.shard))
        slots = [s for s in trained if s.dim is not None]
        if n == 1:
            for slot in slots:
                slot.piece_of(_local(slot.param), 0).copy_(_local(slot.shard))
            return
        sizes = [torch.empty(s.chunk_numel, dtype=s.shard.dtype, device="meta") for s in slots]
        for run in _buckets(sizes, BUCKET_BYTES // n):
            total = sum(slots[i].chunk_numel for i in run)
            mine = _local(slots[run[0]].shard).new_zeros(total)
            offset = 0
            for i in run:
                piece = _local(slots[i].shard).reshape(-1)
                mine[offset : offset + piece.numel()].copy_(piece)
                offset += slots[i].chunk_numel
            out = mine.new_empty(n * total)
            _all_gather_single(out, mine, group=group)
            for r in range(n):
                offset = r * total
                for i in run:
                    slot = slots[i]
                    target = slot.piece_of(_local(slot.param), r)
                    count = target.numel()
                    target.copy_(out[offset : offset + count].view(target.shape))
                    offset += slot.chunk_numel

    @torch.optim.Optimizer.profile_hook_step
    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        """Cut this rank's slices from the parameters, step them with this rank's slice of
        each (averaged) gradient, then gather the whole parameters.

        The step hooks registered on this optimizer and torch's global optimizer hooks run
        around it, as around any torch optimizer's step; the wrapped optimizer's own step
        hooks run around its step, and the global ones do not run again there (a global
        hook sees one step, of this optimizer), unless something replaced the wrapped
        optimizer's ``step`` (an LR scheduler built on it), which then runs as it is.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refresh()
        self._slice_gradients()
        _step_inner(self.inner, kwargs)
        self._gather()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for slot in self._slots:
            slot.shard.grad = None
            if slot.param.grad is not None:
                if set_to_none:
                    slot.param.grad = None
                else:
                    slot.param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, with this optimizer's state-dict hooks run
        around it as ``torch.optim.Optimizer.state_dict`` runs them."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self.inner.state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer, its slices first cut afresh from the model: state
        it makes from its parameters on load (``hlat_optim.AdamW``'s master weights, where
        the state dict lacks them) comes from the model's weights as they are (load the
        model first). This optimizer's load hooks run around it, as
        ``torch.optim.Optimizer.load_state_dict`` runs them."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._refresh()
        self.inner.load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("Zero1Optimizer: build it with every parameter group")


def zero1_optimizer(
    optimizer_cls: Callable[..., torch.optim.Optimizer],
    params: Iterable[Any],
    dims: ParallelDims,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """``optimizer_cls(params, **kwargs)`` as ZeRO-1: its state sharded 1/dp (x cp) per
    rank, parameters and gradients whole (a model parallelized with ``dp_shard="zero1"``;
    average its gradients with :func:`sync_gradients` before clipping and stepping).

    neuron backend: NeuronX Distributed's ``NeuronZero1Optimizer``, as
    :func:`~hlat_parallel.shard_optimizer` builds it there.
    """
    if dims.backend == "neuron":
        from hlat_parallel.neuron_backend import neuron_zero1_optimizer

        return neuron_zero1_optimizer(optimizer_cls, list(params), dims, **kwargs)  # type: ignore[arg-type]
    return Zero1Optimizer(optimizer_cls, params, dims, **kwargs)


def _step_inner(inner: torch.optim.Optimizer, kwargs: dict[str, Any]) -> None:
    """Step the wrapped optimizer with its own step hooks but not torch's global ones, which
    ran around the ZeRO-1 step; a ``step`` replaced on the instance, or one without torch's
    hook wrapper, is called as it is."""
    step = type(inner).step
    if "step" in vars(inner) or not getattr(step, "hooked", False):
        inner.step(**kwargs)
        return
    args: tuple[Any, ...] = (inner,)
    for pre_hook in inner._optimizer_step_pre_hooks.values():
        result = pre_hook(inner, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"a step pre-hook must return None or (new_args, new_kwargs), got {result}"
                )
            args, kwargs = result
    step.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]
    inner._optimizer_step_code()
    for post_hook in inner._optimizer_step_post_hooks.values():
        post_hook(inner, args, kwargs)
