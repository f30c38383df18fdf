"""AdamW for bf16 training: fp32 update math, stochastic rounding on write-back."""

from __future__ import annotations

import functools
import importlib
import itertools
import math
import operator
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import torch
import torch.fx.experimental._config as fx_config

from hlat_optim import _native
from hlat_optim.clip import scale_in_place
from hlat_optim.rounding import (
    _is_dtensor,
    _local,
    _lsr,
    hashed_bits,
    round_to_nearest,
    round_with_bits,
)

__all__ = ["AdamW", "adamw_update", "adamw_update_flat"]

_GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay", "seed")
"""The settings of a param group this optimizer reads at each step."""
_MODE_SETTINGS = (
    "stochastic_rounding",
    "state_dtype",
    "master_weights",
    "kahan_sum",
    "impl",
    "compile_backend",
)
"""The constructor's settings an ``AdamW`` keeps besides its param groups' (its precision
mode and path)."""
_SUPPORTED = (torch.float32, torch.bfloat16)
_IMPLS = ("auto", "native", "compiled", "reference")
_HYPER_WIDTH = 7  # adamw_update's hyper
_TABLE_WIDTH = _HYPER_WIDTH + 2  # hyper, key, offset
# Graphs of the compiled group update a process may hold: a few groups per optimizer, and
# processes (tests, notebooks) that build optimizers for several models.
_RECOMPILE_LIMIT = 128
# Elements per block of adamw_update_flat's buffers, where every tensor starts on a block.
FLAT_BLOCK = 1024
# Elements per call of the compiled update at most, unless one tensor has more: parameters
# and gradients are gathered per call, so this bounds the step's extra memory (256 MiB of
# bf16 parameters and gradients), and a call of this size takes far longer than its launch.
FLAT_BUCKET = 1 << 26
# An odd multiplier: the high 16 bits of (bits * it) are exp_avg_sq's rounding bits.
_SQ_MULT = 0x2C1B3C6D


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    master: torch.Tensor | None,
    hyper: torch.Tensor,
    key: torch.Tensor,
    offset: torch.Tensor,
    stochastic_rounding: bool,
    compensation: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> None:
    """One AdamW update of a flat (1-D, contiguous) parameter and its states, in place.

    This is the reference implementation; ``AdamW`` runs it eagerly for each tensor of a
    group of same-dtype tensors (``impl="reference"``), or the same update of a whole group
    on flat buffers inside one ``torch.compile``d call (``adamw_update_flat``), or, on CPU,
    the equivalent C++ loop in ``_adamw_cpu.cpp``; every path computes the same thing bit for
    bit.

    ``hyper`` is a float32 tensor ``[decay, step_size, 1 - beta1, beta2, 1 - beta2, eps,
    1 / bias_correction2_sqrt]`` with ``decay = 1 - lr * weight_decay``,
    ``step_size = lr / (1 - beta1**step)`` and ``bias_correction2_sqrt = sqrt(1 -
    beta2**step)``, computed in float64 on the host as torch does.
    ``key`` (0-d int32) seeds the rounding bits for this parameter and step; ``offset`` (0-d
    int32) is added to the element index so that a shard draws the bits its elements would
    draw in the whole tensor. With ``master`` (fp32) the update is applied to it and copied
    into ``param`` with round-to-nearest. With ``compensation`` (bf16, Kahan summation) the
    weight is ``param + compensation``: the update is applied to that sum, ``param`` gets it
    rounded to nearest and ``compensation`` what the rounding lost.

    Stochastic rounding draws 32 hashed bits per element (``hashed_bits``): the low 16 round
    the parameter, the high 16 ``exp_avg``, and the high 16 of ``bits * 0x2C1B3C6D`` (an
    odd multiplier) ``exp_avg_sq``. Those last are uniform and independent of the low 16.

    ``skip`` (a 0-d bool tensor on the parameter's device, or ``None``): where it is true,
    every tensor written keeps its value bit for bit, whatever the gradient holds (inf and
    NaN included). The choice is an elementwise select, made on the device.

    Note: the scalars arrive as tensors, not Python floats, so that a compiled kernel is
    reused across steps instead of being recompiled for every new learning rate. ``skip``
    is a tensor so that it can be decided on the device: reading it on the host would wait
    for the device.
    """

    def bits() -> torch.Tensor:
        index = torch.arange(param.numel(), dtype=torch.int32, device=param.device) + offset
        return hashed_bits(index, key)

    tensors = (param, grad, exp_avg, exp_avg_sq, master, compensation)
    _update(tensors, hyper, bits, stochastic_rounding, skip)


def adamw_update_flat(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    master: torch.Tensor | None,
    table: torch.Tensor,
    blocks: torch.Tensor,
    shifts: torch.Tensor,
    stochastic_rounding: bool,
    compensation: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> None:
    """``adamw_update`` of many tensors laid end to end in flat buffers, in place.

    Each tensor starts at a multiple of ``FLAT_BLOCK`` elements (the gaps between them are
    updated too, and hold nothing). ``blocks`` (int32) gives the tensor each block of
    ``FLAT_BLOCK`` elements belongs to, and ``shifts`` (int64) each tensor's index offset
    (as ``adamw_update``'s ``offset``, a signed int32 value) less its start in the buffers.
    ``table`` (int32) holds ``hyper`` (shared by every tensor) as ``_HYPER_WIDTH`` float32
    bit patterns, then each tensor's key. Every element draws the rounding bits it would
    draw in ``adamw_update`` of its own tensor.

    Note: one call updates any number of tensors, so the kernels per step do not grow with
    the number of parameters, and the graph (sizes left symbolic) compiles once for every
    group of the same dtypes. Aligned tensors make an element's tensor one lookup of its
    block, where a search of the tensors' starts would take a dozen.
    """
    hyper = table[:_HYPER_WIDTH].view(torch.float32)
    keys = table[_HYPER_WIDTH:]

    def bits() -> torch.Tensor:
        position = torch.arange(param.numel(), dtype=torch.int64, device=param.device)
        tensor = blocks[position // FLAT_BLOCK]
        # Note: the index within the tensor plus its offset, wrapped to int32 as
        # ``adamw_update``'s sum of two int32 values is.
        index = (position + shifts[tensor]).to(torch.int32)
        return hashed_bits(index, keys[tensor])

    tensors = (param, grad, exp_avg, exp_avg_sq, master, compensation)
    _update(tensors, hyper, bits, stochastic_rounding, skip)


# parameter, gradient, exp_avg, exp_avg_sq, master weights, Kahan compensation
_Tensors = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None
]


def _update(
    tensors: _Tensors,
    hyper: torch.Tensor,
    random_bits: Callable[[], torch.Tensor],
    stochastic_rounding: bool,
    skip: torch.Tensor | None,
) -> None:
    """The update both ``adamw_update`` and ``adamw_update_flat`` make, of ``tensors``
    (parameter, gradient, ``exp_avg``, ``exp_avg_sq``, master weights, compensation);
    ``random_bits()`` gives each element's 32 hashed bits."""
    param, grad, exp_avg, exp_avg_sq, master, compensation = tensors
    decay, step_size, one_minus_beta1, beta2, one_minus_beta2, eps, inv_bc2_sqrt = hyper.unbind(0)
    g = grad.float()
    m = exp_avg.float()
    m = m + one_minus_beta1 * (g - m)
    v = exp_avg_sq.float() * beta2 + one_minus_beta2 * g * g
    # Note: eager CPU float32 sqrt is not correctly rounded in every torch build, while the
    # compiled kernel's is; eagerly, the float64 root rounded once is, so both paths agree
    # bit for bit.
    root = v.sqrt() if torch.compiler.is_compiling() else v.double().sqrt().float()
    # Note: torch divides by bias_correction2_sqrt; multiplying by its inverse (within one
    # ulp of that) leaves one division per element, and division is what bounds a
    # vectorised CPU step.
    denom = root * inv_bc2_sqrt + eps
    w = master if master is not None else param.float()
    if compensation is not None:
        w = w + compensation.float()
    w = w * decay
    w = w - step_size * (m / denom)

    param_sr = master is None and compensation is None and param.dtype == torch.bfloat16
    needs_bits = stochastic_rounding and (param_sr or exp_avg.dtype == torch.bfloat16)
    if needs_bits:
        bits = random_bits()

    if master is not None:
        master.copy_(_unless(skip, master, w))
        param.copy_(_unless(skip, param, w))
    elif compensation is not None:
        rounded = round_to_nearest(w)
        param.copy_(_unless(skip, param, rounded))
        # w - rounded is exact in fp32; rounded to nearest bf16 on the way in
        compensation.copy_(_unless(skip, compensation, w - rounded))
    elif param.dtype == torch.bfloat16 and stochastic_rounding:
        param.copy_(_unless(skip, param, round_with_bits(w, bits & 0xFFFF)))
    else:
        param.copy_(_unless(skip, param, w))

    if exp_avg.dtype == torch.bfloat16 and stochastic_rounding:
        exp_avg.copy_(_unless(skip, exp_avg, round_with_bits(m, _lsr(bits, 16))))
        exp_avg_sq.copy_(_unless(skip, exp_avg_sq, round_with_bits(v, _lsr(bits * _SQ_MULT, 16))))
    else:
        exp_avg.copy_(_unless(skip, exp_avg, m))
        exp_avg_sq.copy_(_unless(skip, exp_avg_sq, v))


def _unless(skip: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` as ``old``'s dtype, or ``old`` itself where ``skip`` is true.

    Note: ``new`` is cast before the select (the cast ``copy_`` would make), so that a
    skipped element is ``old``'s own bits, never a round trip through another dtype.
    """
    if skip is None:
        return new
    return torch.where(skip, old, new.to(old.dtype))


def _adamw_update_group(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    masters: list[torch.Tensor] | None,
    compensations: list[torch.Tensor] | None,
    table: torch.Tensor,
    stochastic_rounding: bool,
    skip: torch.Tensor | None,
) -> None:
    """``adamw_update`` of every tensor of a group that shares a device and dtypes.

    ``table`` (int32, one row of ``_TABLE_WIDTH`` per tensor, on the tensors' device) holds
    each tensor's ``hyper`` as float32 bit patterns, then its ``key`` and its ``offset``.

    Note: the eager reference path (``impl="reference"``, and the fallback where compilation
    fails): one table per group, so the host-to-device copies do not grow with the number
    of parameters, and one eager update per tensor.
    """
    for i, param in enumerate(params):
        row = table[i]
        adamw_update(
            param,
            grads[i],
            exp_avgs[i],
            exp_avg_sqs[i],
            masters[i] if masters is not None else None,
            row[:_HYPER_WIDTH].view(torch.float32),
            row[_HYPER_WIDTH],
            row[_HYPER_WIDTH + 1],
            stochastic_rounding,
            compensations[i] if compensations is not None else None,
            skip,
        )


# inductor settings for the update on devices other than the CPU. Its defaults contract
# multiplies and adds into FMAs, divide approximately and flush subnormals to zero, which
# changes the result of most elements against the eager update; these make every element
# equal to it. Keys the installed torch lacks are left out.
_DEVICE_INDUCTOR_OPTIONS = {
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
}

# The compiled flat update for each (torch.compile backend, device type), made on first use.
_compiled: dict[tuple[str, str], Callable[..., None]] = {}
_compile_lock = threading.Lock()


def _has_inductor_option(key: str) -> bool:
    import torch._inductor.config as inductor_config

    node: Any = inductor_config
    for part in key.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def _compile_options(backend: str, device_type: str) -> dict[str, Any] | None:
    """The ``torch.compile`` options of the update for tensors of ``device_type``."""
    if backend != "inductor" or device_type == "cpu":
        return None
    return {k: v for k, v in _DEVICE_INDUCTOR_OPTIONS.items() if _has_inductor_option(k)}


def _compile_kwargs(backend: str, device_type: str) -> dict[str, Any]:
    """The ``torch.compile`` arguments of the update with ``backend`` for tensors of
    ``device_type``: one graph whatever the buffer sizes (``dynamic=True``) where the backend
    can, else one graph per size.

    Note: TorchNeuron's backend (``"neuron"``) rejects ``dynamic=True`` at compilation (its
    ``torch.compile`` backend reference, Neuron 2.33: shapes that vary compile anew per
    shape); the failed compile made ``impl="auto"`` fall back to the eager update. The
    update's sizes are its buckets' (one per batch of tensors unless they hold more than
    ``FLAT_BUCKET`` elements), a few graphs, far below the recompile limit.
    """
    return {
        "backend": backend,
        "dynamic": backend != "neuron",
        "fullgraph": True,
        "options": _compile_options(backend, device_type),
    }


def _compiled_update(backend: str, device_type: str = "cpu") -> Callable[..., None]:
    """``adamw_update_flat`` through ``torch.compile`` with ``backend``, made once."""
    with _compile_lock:
        fn = _compiled.get((backend, device_type))
        if fn is None:
            compiled = torch.compile(adamw_update_flat, **_compile_kwargs(backend, device_type))

            patches = threading.local()

            def run(*args: Any) -> None:
                # Note: every kind of group (parameter, gradient and state dtypes; master
                # weights or Kahan compensation; rounding mode; with or without skip) is
                # its own graph; torch's default limit of 8 graphs per function would make
                # a process with several kinds fail. Without duck shaping, buffers of equal
                # sizes get sizes of their own, so groups that differ in which sizes repeat
                # share one graph. The patches are made once per thread (making one defines
                # a class), and entered around every call, as a call may compile.
                if not hasattr(patches, "both"):
                    patches.both = (
                        torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT),
                        fx_config.patch(use_duck_shape=False),  # type: ignore[attr-defined]
                    )
                limit, shapes = patches.both
                with limit, shapes:
                    compiled(*args)

            fn = _compiled[backend, device_type] = run
    return fn


_F = TypeVar("_F", bound=Callable[..., Any])


def _not_traced(fn: _F) -> _F:
    """``fn``, left out of ``torch.compile``'s tracing: it runs eagerly inside compiled code.

    Note: a plain function around the disabled one, so that it binds as a method; what
    older torch's ``torch.compiler.disable`` returns does not.
    """
    disabled = torch.compiler.disable(fn, reason=f"{fn.__qualname__} runs eagerly")

    @functools.wraps(fn)
    def eager(*args: Any, **kwargs: Any) -> Any:
        return disabled(*args, **kwargs)

    return cast(_F, eager)


def _default_backend(device: torch.device) -> str:
    """The ``torch.compile`` backend for tensors on ``device``.

    Note: TorchNeuron (device type ``neuron``) compiles through its own backend, ``"neuron"``;
    that choice cannot be tested without a Trainium device. Every other device, CPU included,
    uses inductor.
    """
    return "neuron" if device.type == "neuron" else "inductor"


# Device types whose backend could not allocate pinned host memory.
_UNPINNABLE: set[str] = set()


def _pinnable(device: torch.device) -> bool:
    """Whether host memory pinned for the current accelerator can feed ``device``."""
    if device.type == "cpu" or device.type in _UNPINNABLE:
        return False
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    current = accelerator.current_accelerator() if accelerator is not None else None
    return current is not None and current.type == device.type


def _group_table(
    hypers: list[list[float]], ints: list[tuple[int, int]], device: torch.device
) -> torch.Tensor:
    """One group's ``hyper`` rows and (key, offset) pairs as one int32 table on ``device``.

    Built on the host and copied in one transfer: from pinned memory without waiting where
    the device's backend can pin, else from ordinary memory. The float32 values are the
    float64 ones rounded to nearest, as ``torch.tensor`` rounds them on every path.
    """
    table = _host_empty((len(hypers), _TABLE_WIDTH), torch.int32, device)
    parts = [
        torch.tensor(hypers, dtype=torch.float32).view(torch.int32),
        torch.tensor(ints, dtype=torch.int32),
    ]
    torch.cat(parts, dim=1, out=table)
    return table.to(device, non_blocking=True)


def _flat_table(
    hyper: list[float], keys: list[int] | torch.Tensor, device: torch.device
) -> torch.Tensor:
    """``adamw_update_flat``'s table on ``device``: ``hyper``'s float32 bit patterns, then
    the keys (a list, or an int32 CPU tensor), built on the host and copied in one
    transfer."""
    table = _host_empty((_HYPER_WIDTH + len(keys),), torch.int32, device)
    table[:_HYPER_WIDTH] = torch.tensor(hyper, dtype=torch.float32).view(torch.int32)
    table[_HYPER_WIDTH:] = keys if torch.is_tensor(keys) else torch.tensor(keys, dtype=torch.int32)
    return table.to(device, non_blocking=True)


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor to copy to ``device``: pinned, so that the copy need not wait, where the
    device's backend can pin."""
    if _pinnable(device):
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:
            _UNPINNABLE.add(device.type)
    return torch.empty(shape, dtype=dtype)


def _int32(x: int) -> int:
    """``x`` modulo 2**32, as a signed int32 (the hash's arithmetic wraps)."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def _host_float(x: float | torch.Tensor) -> float:
    """A hyperparameter's value on the host.

    Note: a CPU tensor is read with ``tolist()``, which reads its memory without a
    dispatched scalar read; a tensor on an accelerator has to be copied back, which waits
    for the device, so a tensor ``lr`` belongs on the CPU.
    """
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return float(x.detach().reshape(1).tolist()[0])
    return float(x)


def _step_key(seed: int, step: int, index: int, salt: int) -> int:
    """A 32-bit key from (seed, step, parameter index, shard salt), as a signed int32.

    Note: ``step`` comes from the float32 step count, which stops advancing at 2**24 steps
    (see ``AdamW._run_step``); the keys, and so the rounding bits, repeat from then on.
    """
    h = 0
    for word in (seed, step, index, salt):
        h = (h ^ (word & 0xFFFFFFFF)) * 0x9E3779B1 & 0xFFFFFFFF
        h ^= h >> 16
        h = h * 0x85EBCA6B & 0xFFFFFFFF
        h ^= h >> 13
    return h - (1 << 32) if h >= 1 << 31 else h


def _mix(h: Any, word: Any) -> Any:
    """One round of ``_step_key``'s hash, on Python ints or on int64 tensors of values in
    [0, 2**32): the products are split in two so that no int64 product overflows."""
    h = h ^ (word & 0xFFFFFFFF)
    h = _low_product(h, 0x9E3779B1)
    h = h ^ (h >> 16)
    h = _low_product(h, 0x85EBCA6B)
    return h ^ (h >> 13)


def _low_product(h: Any, factor: int) -> Any:
    """The low 32 bits of ``h * factor`` for ``h`` and ``factor`` in [0, 2**32)."""
    high = (h * (factor >> 16)) & 0xFFFF
    return (h * (factor & 0xFFFF) + high * 0x10000) & 0xFFFFFFFF


def _step_keys(seed: int, step: int, indices: torch.Tensor, salts: torch.Tensor) -> torch.Tensor:
    """``_step_key(seed, step, index, salt)`` of every (index, salt) pair at once: int64
    CPU tensors in, int32 keys out, bit for bit the per-parameter function's."""
    h = _mix(_mix(0, seed), step)
    keys = _mix(_mix(torch.full_like(indices, h), indices), salts)
    # as a signed int32: the values wrap, as _step_key's do
    return (keys - ((keys >> 31) << 32)).to(torch.int32)


def _shard_layout(p: torch.Tensor) -> tuple[int, int]:
    """(index offset, key salt) of a parameter's local shard within its global tensor.

    A plain tensor or a replicated DTensor gives (0, 0), so replicas round identically. A
    shard that is a contiguous range of the global tensor (sharded on dim 0) gets its flat
    offset, so it draws exactly the bits the unsharded tensor would; any other shard gets a
    distinct salt instead, so no two shards share a random stream.
    """
    if not _is_dtensor(p):
        return 0, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    d: Any = p
    local_shape, global_offset = compute_local_shape_and_global_offset(
        d.shape, d.device_mesh, d.placements
    )
    flat = 0
    for off, stride in zip(
        global_offset, torch.empty(p.shape, device="meta").stride(), strict=True
    ):
        flat += off * stride
    if tuple(local_shape[1:]) == tuple(p.shape[1:]):
        return flat, 0
    return 0, flat + 1


_TORCH_ONLY = {
    "maximize": (True, "its updates minimise"),
    "amsgrad": (True, "it keeps no AMSGrad maximum of the second moments"),
    "decoupled_weight_decay": (
        False,
        "its weight decay is always decoupled, AdamW's, never the L2 term added to the "
        "gradient that torch.optim.Adam and AdamW apply with decoupled_weight_decay=False",
    ),
}
"""Options of ``torch.optim.AdamW`` (and ``torch.optim.Adam``) that change its update: the
value this AdamW lacks, and what it does instead."""


def _refuse_torch_only(group: dict[str, Any], where: str, loading: bool = False) -> None:
    """Refuse a param group that sets one of :data:`_TORCH_ONLY` to the value this AdamW
    lacks: its updates would be plain AdamW's without a word (the other value, as torch's
    state dicts hold, is accepted, and so is a group without the option)."""
    asked = [
        (name, value, why)
        for name, (value, why) in _TORCH_ONLY.items()
        if name in group and bool(group[name]) == value
    ]
    if asked:
        done = "; nothing was loaded" if loading else ""
        raise ValueError(
            f"hlat_optim.AdamW: {where} sets "
            f"{', '.join(f'{name}={value}' for name, value, _ in asked)}, which this AdamW "
            f"does not implement ({'; '.join(why for *_, why in asked)}){done}"
        )


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay for fp32 and bf16 parameters.

    Precision modes (bytes per parameter: parameter + gradient + states):

    - bf16 parameters, ``stochastic_rounding=True`` (default, HLAT's mode): the update is
      computed in fp32 and written back with unbiased stochastic rounding; states in bf16
      (8 bytes, the default for bf16 parameters) or fp32 (``state_dtype=torch.float32``, 12).
    - bf16 parameters, ``stochastic_rounding=False``: round-to-nearest write-back, which
      loses updates smaller than half a bf16 ulp (to reproduce the failure).
    - ``kahan_sum=True``: bf16 parameters with a bf16 Kahan compensation each; the update is
      applied to ``parameter + compensation`` and written back with round-to-nearest, the
      rounding error kept in the compensation (10 bytes with bf16 states). States are rounded
      as ``stochastic_rounding`` says.
    - ``master_weights=True``: an fp32 copy of every bf16 parameter takes the update and is
      copied into the parameter with round-to-nearest (mixed precision, 16 bytes).
    - fp32 parameters: plain fp32 AdamW (16 bytes), ``torch.optim.AdamW``'s update within
      about one ulp per step: the bias correction's square root is applied as a
      multiplication by its inverse, where torch divides by it.

    Weight decay is applied to every parameter, norm weights included, unless a param group
    sets ``weight_decay=0``. ``lr`` may be a float or a tensor and is driven by any
    ``torch.optim.lr_scheduler``; a tensor ``lr`` belongs on the CPU, as the host reads it
    every step. The decay is always decoupled: a param group with ``torch.optim``'s
    ``decoupled_weight_decay=False`` (L2 decay), ``maximize=True`` or ``amsgrad=True`` is
    refused.

    Parameters and gradients may be in any memory layout (channels_last, transposed); each
    element is updated, and rounded, as in a contiguous tensor of its shape. The states are
    contiguous. A parameter whose elements may share memory (an expanded one) is refused.

    Rounding bits come from a counter-based hash of (element index, ``seed``, step,
    parameter index), so the whole rounding state is the ``seed`` (in every param group)
    and each parameter's ``step`` (in its state): ``state_dict()`` holds both and resume is
    bit-exact. DTensor parameters are updated shard by shard; a shard of dim 0 rounds exactly
    as the whole tensor would.

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay: as in ``torch.optim.AdamW``.
        stochastic_rounding: round bf16 parameters and bf16 states stochastically.
        state_dtype: dtype of ``exp_avg``/``exp_avg_sq``; ``None`` means the parameter's
            dtype (fp32 when ``master_weights``). A loaded state dict's moments are cast to
            it; with ``None`` they keep their saved dtype (see ``load_state_dict``).
        master_weights: keep an fp32 master copy of bf16 parameters.
        kahan_sum: keep a bf16 Kahan compensation of bf16 parameters instead.
        seed: seed of the rounding bits.
        impl: ``"native"`` (a vectorised C++ loop for CPU tensors, built on first use with
            the host compiler), ``"compiled"`` (the update through ``torch.compile``, on any
            device), ``"reference"`` (the same update run eagerly) or ``"auto"``: native for
            CPU tensors when it builds, compiled otherwise, and the reference with a warning
            if compilation fails. All give bit-identical results. The compiled path groups
            the parameters by device, parameter, gradient and state dtypes (and master
            weights or Kahan compensation), param group and step count, keeps each group's
            states in flat buffers (each state entry a view of one), and makes one call
            per group and step on them, with the group's per-step values in one small table
            copied to the device at once. A step also gathers the group's parameters and
            gradients into one buffer each (at most ``FLAT_BUCKET`` elements), kept between
            steps; from the second step on, a step reuses the first one's work while the
            parameters with gradients, their dtypes, states and memory stay the same.
        compile_backend: the ``torch.compile`` backend of the compiled path; ``None`` means
            ``"neuron"`` for TorchNeuron tensors (device type ``neuron``) and ``"inductor"``
            for every other device.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        stochastic_rounding: bool = True,
        state_dtype: torch.dtype | None = None,
        master_weights: bool = False,
        kahan_sum: bool = False,
        seed: int = 0,
        impl: str = "auto",
        compile_backend: str | None = None,
    ) -> None:
        if not float(lr) >= 0.0:
            raise ValueError(f"AdamW: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW: betas must be in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"AdamW: eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamW: weight_decay must be >= 0, got {weight_decay}")
        if state_dtype not in (None, *_SUPPORTED):
            raise ValueError(
                f"AdamW: state_dtype must be None, torch.float32 or torch.bfloat16, "
                f"got {state_dtype}"
            )
        if kahan_sum and master_weights:
            raise ValueError(
                "AdamW: kahan_sum and master_weights are two ways to keep the bits a bf16 "
                "write-back loses; choose one"
            )
        if impl not in _IMPLS:
            raise ValueError(f"AdamW: impl must be one of {', '.join(_IMPLS)}, got {impl!r}")
        if compile_backend is not None and not (
            isinstance(compile_backend, str) and compile_backend
        ):
            raise ValueError(
                "AdamW: compile_backend must be the name of a torch.compile backend (e.g. "
                f"'inductor') or None, got {compile_backend!r}"
            )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, seed=seed)
        super().__init__(params, defaults)
        self.stochastic_rounding = stochastic_rounding
        self.state_dtype = state_dtype
        self.master_weights = master_weights
        self.kahan_sum = kahan_sum
        self.impl = impl
        self.compile_backend = compile_backend
        self._clear_caches()

    def _clear_caches(self) -> None:
        """Forget what the steps worked out about the parameters; the next step works it
        out again."""
        self._layouts: dict[torch.Tensor, tuple[int, int]] = {}
        # Flat states of the compiled path: by the ids of their parameters, and by parameter.
        self._flat: dict[tuple[int, ...], _FlatStates] = {}
        self._flat_of: dict[torch.Tensor, _FlatStates] = {}
        # What the compiled path reuses from one step to the next (see _Steady).
        self._steady: _Steady | None = None

    def __getstate__(self) -> dict[str, Any]:
        """``torch.optim.Optimizer``'s (defaults, state, param groups) and the precision mode
        and path, so that ``copy.deepcopy`` and pickle give an optimizer that steps on."""
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in _MODE_SETTINGS})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._clear_caches()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``, refusing a group that holds a parameter
        of another dtype than float32 or bfloat16, whose ``seed`` is not an integer, or that
        asks for ``torch.optim.AdamW``'s ``maximize``, ``amsgrad`` or
        ``decoupled_weight_decay=False`` (L2 weight decay), which this AdamW does not have
        (the group is then not added)."""
        _refuse_torch_only(param_group, f"param group {len(self.param_groups)}")
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        seed = self.param_groups[gi]["seed"]
        try:
            operator.index(seed)  # every step hashes it with integer operations
        except TypeError:
            self.param_groups.pop()
            raise TypeError(
                f"AdamW: seed of param group {gi} must be an integer, got {seed!r}"
            ) from None
        for pi, p in enumerate(self.param_groups[gi]["params"]):
            if p.dtype not in _SUPPORTED:
                self.param_groups.pop()
                raise TypeError(
                    f"AdamW: parameter {pi} of param group {gi} (shape {tuple(p.shape)}) "
                    f"is {p.dtype}; only float32 and bfloat16 parameters are supported "
                    "(cast the model with .to(torch.bfloat16) or .float())"
                )

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        master = self.master_weights and p.dtype == torch.bfloat16
        dtype = self.state_dtype or (torch.float32 if master else p.dtype)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(
            p, dtype=dtype, memory_format=torch.contiguous_format
        )
        if master:
            state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format)
        if self.kahan_sum and p.dtype == torch.bfloat16:
            state["compensation"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` into this optimizer's precision mode.

        Every state tensor must have its parameter's shape (for DTensors, that of the local
        shard): a state dict of other parameters is refused before anything is loaded.
        The constructor's mode wins: fp32 master weights that ``master_weights=True`` needs
        and the state dict lacks are made from the parameters as they are (load the model's
        weights first), a Kahan compensation that ``kahan_sum=True`` needs starts at zero,
        and master weights or compensations this optimizer does not keep are dropped. The
        moments keep their saved dtype where ``state_dtype`` is None, and are cast to it
        (rounded to nearest) where it is given. One warning names the conversions made. A
        param group saved without one of the constructor's defaults (``seed``, in a
        ``torch.optim.AdamW`` state dict) takes the constructor's value.

        Note: ``torch.optim.Optimizer`` casts floating-point state to the parameter's dtype on
        load, which would turn fp32 master weights and fp32 moments of bf16 parameters into
        bf16; the saved tensors are put back with their own dtype afterwards. A step count
        saved anywhere else than in a CPU float32 tensor is brought there, as ``step()``
        reads all counts on the host at once.
        """
        groups = []
        for gi, group in enumerate(state_dict["param_groups"]):
            if "decoupled_weight_decay" in group and not group["decoupled_weight_decay"]:
                # Note: as torch.optim.AdamW's own load does, a torch.optim.Adam state dict
                # (L2 decay) loads with AdamW's decoupled decay; only a group built here
                # with decoupled_weight_decay=False is refused
                group = {**group, "decoupled_weight_decay": True}
            _refuse_torch_only(group, f"the state dict's param group {gi}", loading=True)
            groups.append(group)
        state_dict = {**state_dict, "param_groups": groups}
        saved = state_dict["state"]
        pairs = _saved_pairs(state_dict["param_groups"], self.param_groups)
        for index, (pid, p) in enumerate(pairs):
            entries = saved.get(pid, {})
            why = _shape_error(
                _local(p),
                ((name, _local(entries[name])) for name in _STATE_NAMES if name in entries),
            )
            if why is not None:
                raise ValueError(
                    f"hlat_optim.AdamW.load_state_dict: parameter {index}'s {why}; the state "
                    "dict holds other parameters' states, and nothing was loaded"
                )
        self._steady = None
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for name in _GROUP_SETTINGS:  # not torch's own defaults ("differentiable")
                group.setdefault(name, self.defaults[name])
        conversions: dict[str, int] = {}
        for pid, p in pairs:
            if p not in self.state:  # saved without state (before its first step): none made
                continue
            for name, value in saved.get(pid, {}).items():
                if torch.is_tensor(value) and name != "step" and value.dtype != p.dtype:
                    self.state[p][name] = value.detach().to(_local(p).device, copy=True)
            step = self.state[p].get("step")
            if step is not None and not (
                torch.is_tensor(step)
                and step.device.type == "cpu"
                and step.dtype == torch.float32
                and step.dim() == 0
            ):
                self.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32)
            for made in self._to_mode(p, self.state[p]):
                conversions[made] = conversions.get(made, 0) + 1
        if conversions:
            made = ", ".join(
                f"{what} ({n} parameter{'s' if n > 1 else ''})" for what, n in conversions.items()
            )
            warnings.warn(
                "hlat_optim.AdamW.load_state_dict: the state dict was saved in another "
                f"precision mode than this optimizer's; converted to it: {made}",
                stacklevel=2,
            )

    def _to_mode(self, p: torch.Tensor, state: dict[str, Any]) -> list[str]:
        """Bring one parameter's loaded state to this optimizer's precision mode; what was
        converted."""
        if not state:
            return []
        done = []
        bf16 = p.dtype == torch.bfloat16
        if self.master_weights and bf16 and "master" not in state:
            state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format)
            done.append("made fp32 master weights from the parameters")
        elif not (self.master_weights and bf16) and state.pop("master", None) is not None:
            done.append("dropped master weights")
        if self.kahan_sum and bf16 and "compensation" not in state:
            state["compensation"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            done.append("made zero Kahan compensations")
        elif not (self.kahan_sum and bf16) and state.pop("compensation", None) is not None:
            done.append("dropped Kahan compensations")
        moments = [name for name in ("exp_avg", "exp_avg_sq") if name in state]
        if self.state_dtype is not None and any(
            state[name].dtype != self.state_dtype for name in moments
        ):
            for name in moments:
                state[name] = state[name].to(self.state_dtype)
            done.append(f"exp_avg and exp_avg_sq cast to {self.state_dtype}")
        # Note: the update reads states as contiguous tensors whatever the parameter's
        # layout; a state saved in another (``torch.optim.AdamW`` keeps a channels_last
        # parameter's channels_last) is copied into the row-major order of its shape, the
        # same values, without a warning.
        for entry in _STATE_NAMES:
            t = state.get(entry)
            if t is not None and not _local(t).is_contiguous():
                state[entry] = t.contiguous()
        return done

    def _native_reason(self, local: list[torch.Tensor | None]) -> str | None:
        """Why the CPU kernel cannot update this parameter, or None if it can."""
        grad = local[1]
        assert grad is not None
        if not all(t.device.type == "cpu" for t in local if t is not None):
            return "it runs on CPU tensors only"
        if grad.dtype not in _SUPPORTED:
            return f"the gradient is {grad.dtype}, not float32 or bfloat16"
        if _native.load() is None:
            return f"the kernel could not be built: {_native.unavailable_reason()}"
        return None

    def _run_flat(self, batch: _FlatBatch, skip: torch.Tensor | None) -> None:
        """One compiled call per bucket of a batch's tensors (one bucket unless they hold
        more than ``FLAT_BUCKET`` elements), on flat buffers: the optimizer's own flat
        states, and the parameters and gradients gathered into one buffer each."""
        plan = self._flat_plan(batch)
        keys = [_step_key(batch.seed, batch.step, index, salt) for index, salt in batch.keys]
        backend = self.compile_backend or _default_backend(batch.device)
        done = 0
        try:
            update = _compiled_update(backend, batch.device.type)
            for bucket in plan.buckets:
                self._run_bucket(update, plan, bucket, batch, keys, skip)
                done += 1
        except Exception as exc:
            # Note: only a failed compilation; any other error (out of memory, a wrong
            # shape) says nothing about the compiled path and is raised as it is.
            if self.impl == "compiled" or not isinstance(exc, _compile_errors()):
                raise
            warnings.warn(
                f"hlat_optim.AdamW: torch.compile of the update failed ({type(exc).__name__}: "
                f"{exc}); using the eager reference update from now on (same results, slower). "
                "Pass impl='reference' to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
            self.impl = "reference"
            # Note: a compile fails on its first call, before that call wrote anything; the
            # buckets before it are done.
            group = _Group(batch.device)
            for bucket in plan.buckets[done:]:
                for i in bucket.tensors:
                    local: list[torch.Tensor | None] = [batch.params[i], batch.grads[i]]
                    local += [plan.part(name, i) for name in _STATE_NAMES]
                    group.add(local, batch.hyper, keys[i], batch.offsets[i])
            group.run(self.stochastic_rounding, skip)

    def _run_bucket(
        self,
        update: Callable[..., None],
        plan: _FlatStates,
        bucket: _Bucket,
        batch: _FlatBatch,
        keys: list[int],
        skip: torch.Tensor | None,
    ) -> None:
        """The compiled call of one bucket: its parameters and gradients gathered, updated
        with the states' range of the bucket, and the parameters written back; each copy
        is one call for all the bucket's tensors."""
        tensors = bucket.tensors
        params = batch.params[tensors.start : tensors.stop]
        flat_param = bucket.gather(params)
        flat_grad = bucket.gather(batch.grads[tensors.start : tensors.stop])
        # Note: one more key than tensors, see _Bucket.
        table = _flat_table(batch.hyper, [*keys[tensors.start : tensors.stop], 0], batch.device)
        plan.update(update, bucket, flat_param, flat_grad, table, self.stochastic_rounding, skip)
        torch._foreach_copy_(params, bucket.parts_like(flat_param, params))

    def _flat_plan(self, batch: _FlatBatch) -> _FlatStates:
        """The flat states of a batch's parameters, made (or made again, after
        ``load_state_dict`` replaced the states) on first use."""
        ids = tuple(id(p) for p in batch.owners)
        plan = self._flat.get(ids)
        if plan is not None and plan.owns(self.state):
            return plan
        for p in batch.owners:
            old = self._flat_of.pop(p, None)
            if old is not None and self._flat.get(old.ids) is old:
                # Note: its other parameters get states of their own, so that the old
                # buffers are freed.
                del self._flat[old.ids]
                old.release(self.state)
        plan = _FlatStates(batch.owners, self.state, batch.offsets)
        self._flat[ids] = plan
        for p in batch.owners:
            self._flat_of[p] = plan
        return plan

    # Note: a step traced by torch.compile would hand the CPU kernel pointers into tensors
    # that the graph frees before the call; the update paths compile on their own.
    @_not_traced
    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        *,
        skip: torch.Tensor | None = None,
        clip_coef: torch.Tensor | None = None,
    ) -> float | None:
        """One optimizer step over every parameter that has a gradient.

        ``skip``: a 0-d ``torch.bool`` tensor on the parameters' device (or on the CPU, then
        copied to each device). Where it holds true, parameters, master weights, Kahan
        compensations and moments keep their exact values, even if the gradients hold inf or
        NaN; it is never read on the host, so a step that decides on the device (e.g. on a
        non-finite gradient norm) makes the host wait for nothing.

        The step makes no scalar read per parameter: the step counts are read on the host
        all at once, and the compiled and reference paths make one call per group of
        parameters that share a device and dtypes.

        Note: the step counts advance on a skipped step too (they live on the host, and
        advancing them depending on ``skip`` would mean reading it there), so bias correction
        and rounding keys count attempted steps: after skipped steps the moments' bias
        correction counts steps they did not see, a difference that vanishes as
        ``beta**step`` does.

        ``clip_coef``: a 0-d float tensor on the parameters' device (or on the CPU), the
        multiplier of every gradient, as :func:`hlat_optim.clip_coefficient` gives it: the
        update is that of the gradients multiplied by it in their own dtype (the coefficient
        rounded to it), bit for bit what :func:`hlat_optim.clip_grad_norm_`'s in-place
        multiply followed by a step gives, without a pass over the gradients of its own on
        the CPU kernel. What ``.grad`` holds afterwards depends on the path: the CPU kernel
        reads the gradients and leaves them as they were, the other paths multiply them in
        place first. A DTensor gradient in another layout than its parameter (a sequence-
        parallel norm weight's ``Partial`` one) is multiplied on every path after it is
        brought to the parameter's layout, where ``clip_grad_norm_`` multiplies each rank's
        part of it; its ``.grad`` is left as it was. Never read on the host.

        Under ``torch.compile`` (``torch.compile(opt.step)``, or a compiled function that
        calls it) the step is not traced: it runs eagerly, as without compilation.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _check_scalar("skip", skip, "torch.bool", lambda t: t.dtype == torch.bool)
        _check_scalar("clip_coef", clip_coef, "floating-point", torch.is_floating_point)
        if self._steady is not None and self._steady.step(self, skip, clip_coef):
            return loss
        self._steady = None
        self._run_step(skip, clip_coef)
        return loss

    def _run_step(self, skip: torch.Tensor | None, clip_coef: torch.Tensor | None) -> None:
        """:meth:`step` past its checks and the steady path."""
        todo: list[tuple[dict[str, Any], torch.Tensor, int]] = []
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"hlat_optim.AdamW: parameter {index} has a sparse gradient, which is "
                        "not supported"
                    )
                for name, flag in (("skip", skip), ("clip_coef", clip_coef)):
                    if flag is not None and flag.device.type != "cpu" and p.device.type == "cpu":
                        raise ValueError(
                            f"hlat_optim.AdamW.step: {name} is on {flag.device} but parameter "
                            f"{index} is on the CPU, where the update reads it; pass {name} on "
                            "the CPU"
                        )
                todo.append((group, p, index))
        # Everything that can fail is checked before any state changes.
        prepared = []
        for group, p, index in todo:
            state = self.state[p]
            if not state:
                self._init_state(p, state)
            local, offset, salt = self._locals(p, state, index)
            native = False
            if self.impl in ("auto", "native"):
                why = self._native_reason(local)
                if why is not None and self.impl == "native":
                    raise RuntimeError(f"hlat_optim.AdamW(impl='native'): {why}")
                native = why is None
            prepared.append((group, p, state, index, local, offset, salt, native))
        if not prepared:
            return
        counters = [state["step"] for _, _, state, *_ in prepared]
        torch._foreach_add_(counters, 1.0)  # one call for all parameters' step counts
        # Note: one read of all counts; tolist() on a CPU tensor reads its memory directly,
        # where .item() per parameter would be a dispatched scalar read each.
        steps = torch.stack(counters).tolist()
        batch = _NativeBatch()
        in_place: list[torch.Tensor] = []  # gradients the other paths read, multiplied first
        groups: dict[tuple[Any, ...], _Group] = {}
        flats: dict[tuple[Any, ...], _FlatBatch] = {}
        hypers: dict[tuple[int, int], list[float]] = {}
        for (group, p, _, index, local, offset, salt, native), count in zip(
            prepared, steps, strict=True
        ):
            # Note: the rounding keys are derived from this count, which is a float32 state
            # (``torch.optim.AdamW``'s format, kept for checkpoints): it counts exactly up to
            # 2**24 = 16,777,216 steps, where adding one leaves it unchanged. From then on
            # every step of a parameter draws the same rounding bits (the bias corrections
            # are 1 by then either way). HLAT's runs take about 450K steps, far below.
            step = int(count)
            hyper = hypers.get((id(group), step))
            if hyper is None:
                hyper = hypers[id(group), step] = _hyper(group, step)
            if native:
                key = _step_key(group["seed"], step, index, salt)
                batch.add(local, hyper, key, offset, self.stochastic_rounding, index)
                continue
            param, grad, exp_avg, _, master, compensation = local
            assert param is not None and grad is not None and exp_avg is not None
            if clip_coef is not None:
                in_place.append(grad)
            signature = (
                param.device,
                param.dtype,
                grad.dtype,
                exp_avg.dtype,
                master is not None,
                compensation is not None,
            )
            if self.impl == "reference":
                if signature not in groups:
                    groups[signature] = _Group(param.device)
                key = _step_key(group["seed"], step, index, salt)
                groups[signature].add(local, hyper, key, offset)
                continue
            # Note: a flat update shares one hyper row, so its tensors share a param group
            # and a step count.
            where = (*signature, id(group), step)
            if where not in flats:
                flats[where] = _FlatBatch(param.device, hyper, group["seed"], step)
            flats[where].add(p, param, grad, index, offset, salt)
        native_coef = None
        if clip_coef is not None and batch.rows:
            native_coef = clip_coef.to(torch.float32)  # a no-op for a CPU fp32 coefficient
        batch.run(skip, native_coef)
        if clip_coef is not None:
            scale_in_place(in_place, clip_coef)
        on_device: dict[torch.device, torch.Tensor] = {}

        def flag_on(device: torch.device) -> torch.Tensor | None:
            if skip is None or skip.device == device:
                return skip
            if device not in on_device:
                on_device[device] = skip.to(device, non_blocking=True)
            return on_device[device]

        for g in groups.values():
            g.run(self.stochastic_rounding, flag_on(g.device))
        for flat in flats.values():
            self._run_flat(flat, flag_on(flat.device))
        if flats and not groups and not batch.rows and self.impl in ("auto", "compiled"):
            # Note: every parameter went through the compiled flat path; the next steps
            # reuse what this one worked out while nothing it depends on changes.
            self._steady = _Steady(self, list(flats.values()))

    def _locals(
        self, p: torch.Tensor, state: dict[str, Any], index: int
    ) -> tuple[list[torch.Tensor | None], int, int]:
        """The local tensors of one update (parameter, gradient, states, master weights,
        compensation), and the index offset and key salt of its shard. The parameter and
        gradient may be in any layout (channels_last, transposed); the states are
        contiguous."""
        if p not in self._layouts:
            self._layouts[p] = _shard_layout(p)
        offset, salt = self._layouts[p]
        grad: Any = p.grad
        pd: Any = p
        if _is_dtensor(grad) and _is_dtensor(p) and tuple(grad.placements) != tuple(pd.placements):
            # Note: DTensor's autograd may leave a gradient in another layout than its
            # parameter (a vocab-parallel embedding's comes back Replicate, a sequence-
            # parallel norm weight's Partial); the update works on local shards, so the
            # gradient is brought to the parameter's layout first.
            grad = grad.redistribute(pd.device_mesh, pd.placements)
        tensors = [
            p,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state.get("master"),
            state.get("compensation"),
        ]
        local = [_local(t) if t is not None else None for t in tensors]
        why = _layout_error(local)
        if why is None:
            why = _update_error(local)
        if why is not None:
            raise RuntimeError(
                f"hlat_optim.AdamW: parameter {index} (shape {tuple(p.shape)}) cannot be "
                f"updated: {why}"
            )
        return local, offset, salt


def _saved_pairs(
    saved: list[dict[str, Any]], groups: list[dict[str, Any]]
) -> list[tuple[Any, torch.Tensor]]:
    """(saved id, parameter) of every parameter, where the saved param groups match these
    in number and sizes; else none (``torch.optim.Optimizer.load_state_dict`` refuses them)."""
    if len(saved) != len(groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(saved, groups, strict=True)
    ):
        return []
    ids = itertools.chain.from_iterable(g["params"] for g in saved)
    params = itertools.chain.from_iterable(g["params"] for g in groups)
    return list(zip(ids, params, strict=True))


def _shape_error(param: torch.Tensor, states: Iterable[tuple[str, Any]]) -> str | None:
    """Which state (name, local tensor) has another shape than the local parameter
    ``param``, and both shapes; None where every tensor has its shape."""
    for name, t in states:
        if torch.is_tensor(t) and t.shape != param.shape:
            return f"{name} has shape {tuple(t.shape)} where the parameter has {tuple(param.shape)}"
    return None


def _layout_error(local: list[torch.Tensor | None]) -> str | None:
    """Why one update's local tensors (as ``AdamW._locals`` gives them) are in a memory
    layout the update cannot take, or None.

    The parameter and its gradient may have any strides (channels_last, transposed, a
    slice): every path updates their elements in row-major order, through a contiguous copy
    of one that is not contiguous, whose update is written back into the parameter. Only a
    parameter whose elements may share memory (an expanded one) is refused: its update could
    not be written back. The states are the optimizer's own, contiguous (``_init_state``,
    ``load_state_dict``), which the CPU kernel and the flat states rely on.
    """
    param = local[0]
    assert param is not None
    if not param.is_contiguous() and _may_overlap(param):
        return (
            f"its elements may share memory (strides {tuple(param.stride())}, as an expanded "
            "tensor's), so no update can be written back to it; give the parameter memory "
            "of its own (.clone()) before building the optimizer"
        )
    for name, t in zip(_STATE_NAMES, local[2:], strict=True):
        if t is not None and not t.is_contiguous():
            return f"its {name} is not contiguous (strides {tuple(t.stride())})"
    return None


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: its dimensions of more than one
    element, taken by increasing stride, must each step past everything the smaller ones
    reach (as any permutation or slice of a dense tensor does)."""
    reach = 0  # the largest offset the dimensions taken so far reach
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride(), strict=True))
    for stride, size in dims:
        if size > 1:
            if stride <= reach:
                return True
            reach += (size - 1) * stride
    return False


def _update_error(local: list[torch.Tensor | None]) -> str | None:
    """Why one update's local tensors (as ``AdamW._locals`` gives them) cannot be updated
    together on every path, or None.

    Note: checked before the step counts advance; the CPU kernel reads each tensor as its
    row's dtype flags and element count say, so a state of another shape or dtype would be
    read past its end or misread there.
    """
    param, _, exp_avg, exp_avg_sq, master, compensation = local
    assert param is not None and exp_avg is not None and exp_avg_sq is not None
    shape = param.shape
    if (
        master is None
        and compensation is None
        and exp_avg.shape == shape
        and exp_avg_sq.shape == shape
        and exp_avg.dtype in _SUPPORTED
        and exp_avg_sq.dtype == exp_avg.dtype
    ):
        return None  # the common case, in few operations: this runs for every parameter
    why = _shape_error(param, zip(_STATE_NAMES, local[2:], strict=True))
    if why is not None:
        return f"its {why}"
    if exp_avg.dtype not in _SUPPORTED or exp_avg_sq.dtype != exp_avg.dtype:
        return (
            f"its exp_avg and exp_avg_sq are {exp_avg.dtype} and {exp_avg_sq.dtype}, where "
            "both must be float32 or both bfloat16"
        )
    if master is None and compensation is None:
        return None
    kept = "master weights" if master is not None else "a Kahan compensation"
    if param.dtype != torch.bfloat16:
        return f"it is {param.dtype} and has {kept}, which only bfloat16 parameters keep"
    if master is not None and compensation is not None:
        return "it has both master weights and a Kahan compensation"
    if master is not None and master.dtype != torch.float32:
        return f"its master weights are {master.dtype}, not float32"
    if compensation is not None and compensation.dtype != torch.bfloat16:
        return f"its Kahan compensation is {compensation.dtype}, not bfloat16"
    return None


def _compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of a failed ``torch.compile`` that the installed torch defines:
    dynamo's for a backend that failed, for code it cannot trace and for its own errors,
    the ones it raises unwrapped (``ShortenTraceback``: inductor's ``TritonMissing`` and
    ``GPUTooOldForTriton``), and inductor's."""
    found: list[type[BaseException]] = []
    for module, names in (
        (
            "torch._dynamo.exc",
            (
                "BackendCompilerFailed",
                "Unsupported",
                "InternalTorchDynamoError",
                "ShortenTraceback",
            ),
        ),
        ("torch._inductor.exc", ("InductorError", "CppCompileError")),
    ):
        try:
            loaded = importlib.import_module(module)
        except Exception:
            continue
        for name in names:
            cls = getattr(loaded, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    return tuple(found)


def _hyper(group: dict[str, Any], step: int) -> list[float]:
    """``adamw_update``'s ``hyper`` for a param group at a step, in float64 as torch does."""
    lr = _host_float(group["lr"])
    beta1, beta2 = group["betas"]
    return [
        1.0 - lr * group["weight_decay"],
        lr / (1.0 - beta1**step),
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        group["eps"],
        1.0 / math.sqrt(1.0 - beta2**step),
    ]


class _Group:
    """The updates of one step that share a device and dtypes, for the eager reference
    update (``impl="reference"``, or the fallback where compilation fails)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tensors: list[list[torch.Tensor]] = [[] for _ in range(6)]
        self.hypers: list[list[float]] = []
        self.ints: list[tuple[int, int]] = []

    def add(
        self, local: list[torch.Tensor | None], hyper: list[float], key: int, offset: int
    ) -> None:
        for column, t in zip(self.tensors, local, strict=True):
            if t is not None:
                column.append(t)
        self.hypers.append(hyper)
        self.ints.append((key, _int32(offset)))

    def run(self, stochastic_rounding: bool, skip: torch.Tensor | None) -> None:
        """The group's ``_adamw_update_group`` call, with the group's table copied to its
        device at once.

        Note: the tensors are flattened here, after ``step`` multiplied the gradients by
        ``clip_coef``. A parameter or gradient that is not contiguous is updated through a
        contiguous copy (its elements in row-major order, as in a contiguous tensor of its
        shape, so each draws the same rounding bits), and the parameter's copy is written
        back after the update.
        """
        table = _group_table(self.hypers, self.ints, self.device)
        params, grads, exp_avgs, exp_avg_sqs, masters, compensations = (
            [_flat(t) for t in column] for column in self.tensors
        )
        _adamw_update_group(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            masters or None,
            compensations or None,
            table,
            stochastic_rounding,
            skip,
        )
        _write_back(self.tensors[0], params)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat contiguous tensor in row-major order: a view of it where it is
    contiguous, else a copy."""
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _write_back(params: list[torch.Tensor], flats: list[torch.Tensor]) -> None:
    """Copy each updated flat tensor of ``flats`` into its parameter where it is a copy (the
    parameter is not contiguous), in one call."""
    copies = [(p, f) for p, f in zip(params, flats, strict=True) if not p.is_contiguous()]
    if copies:
        torch._foreach_copy_([p for p, _ in copies], [f.view(p.shape) for p, f in copies])


_STATE_NAMES = ("exp_avg", "exp_avg_sq", "master", "compensation")


class _FlatBatch:
    """The updates of one step that share a device, dtypes, param group and step count:
    one call of the compiled flat update."""

    def __init__(self, device: torch.device, hyper: list[float], seed: int, step: int) -> None:
        self.device = device
        self.hyper = hyper
        self.seed = seed
        self.step = step
        self.owners: list[torch.Tensor] = []  # the parameters, as the optimizer holds them
        self.locals: list[torch.Tensor] = []  # their local tensors
        self.params: list[torch.Tensor] = []  # the same (in any layout)
        self.grads: list[torch.Tensor] = []  # the local gradients (in any layout)
        self.keys: list[tuple[int, int]] = []  # (parameter index, key salt)
        self.offsets: list[int] = []

    def add(
        self,
        owner: torch.Tensor,
        param: torch.Tensor,
        grad: torch.Tensor,
        index: int,
        offset: int,
        salt: int,
    ) -> None:
        self.owners.append(owner)
        self.locals.append(param)
        self.params.append(param)
        self.grads.append(grad)
        self.keys.append((index, salt))
        self.offsets.append(_int32(offset))


class _Bucket:
    """Consecutive tensors of a ``_FlatStates``, updated by one compiled call: their range
    of the flat buffers, and the layout ``adamw_update_flat`` reads, on the device."""

    def __init__(
        self,
        tensors: range,
        sizes: list[int],
        spans: list[int],
        starts: list[int],
        offsets: list[int],
        device: torch.device,
    ) -> None:
        self.tensors = tensors
        self.begin = starts[tensors.start]
        self.end = starts[tensors.stop]
        # sizes of the parts and of the gaps after them, for split_with_sizes
        self.splits = [x for i in tensors for x in (sizes[i], spans[i] - sizes[i])]
        # Note: one block, shift and key more than there are, which no element reads: a
        # graph compiled for a dimension of size 1 is specialised to it, so a bucket of one
        # small tensor would compile a graph of its own.
        counts = [spans[i] // FLAT_BLOCK for i in tensors] + [1]
        self.blocks = torch.repeat_interleave(
            torch.arange(len(counts), dtype=torch.int32), torch.tensor(counts)
        ).to(device)
        shifts = [offsets[i] - (starts[i] - self.begin) for i in tensors] + [0]
        self.shifts = torch.tensor(shifts, dtype=torch.int64).to(device)

    def of(self, buffer: torch.Tensor) -> torch.Tensor:
        """This bucket's range of a flat buffer of all the tensors."""
        return buffer.narrow(0, self.begin, self.end - self.begin)

    def parts(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's part of a buffer of this bucket's elements (1-D views)."""
        return list(buffer.split_with_sizes(self.splits)[::2])

    def parts_like(self, buffer: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's part of a buffer of this bucket's elements, viewed in the shape of
        its tensor of ``tensors`` (one per tensor of the bucket).

        Note: a part holds its tensor's elements in row-major order whatever the tensor's
        strides (channels_last, transposed), so an element draws the rounding bits it would
        draw in a contiguous tensor; copies from and to the tensor follow its strides.
        """
        return [part.view(t.shape) for part, t in zip(self.parts(buffer), tensors, strict=True)]

    def gather(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """A new buffer with ``tensors`` (one per tensor of the bucket, in any layout) in
        their parts; the gaps hold whatever the memory held."""
        buffer = tensors[0].new_empty(self.end - self.begin)
        torch._foreach_copy_(self.parts_like(buffer, tensors), tensors)
        return buffer


class _FlatStates:
    """The optimizer states of a list of parameters, one flat buffer per state, each
    parameter's part starting on a multiple of ``FLAT_BLOCK`` elements, in order; each
    parameter's state entry is a view of its part (a DTensor over that view for a DTensor
    state), so ``state_dict()`` and checkpoints see them as before. The parameters are cut
    into buckets of consecutive ones, of at most ``FLAT_BUCKET`` elements unless one
    parameter is larger, each updated by one call.

    The step counts are views of one CPU float32 tensor in the same way (``steps``), so a
    step advances them all with one addition.

    Note: made from the states as they are (fresh zeros on the first step, or what
    ``load_state_dict`` put there), copied once; the old tensors are freed after the step.
    """

    def __init__(self, owners: list[torch.Tensor], state: Any, offsets: list[int]) -> None:
        self.owners = list(owners)
        self.ids = tuple(id(p) for p in owners)
        states = [state[p] for p in owners]
        self.names = [name for name in _STATE_NAMES if name in states[0]]
        # Note: stacked, not read, so that no count is read on the host here.
        self.steps = torch.stack([s["step"] for s in states]).to(torch.float32)
        for s, count in zip(states, self.steps.unbind(0), strict=True):
            s["step"] = count
        sizes = [_local(s["exp_avg"]).numel() for s in states]
        spans = [-(-n // FLAT_BLOCK) * FLAT_BLOCK for n in sizes]
        starts = list(itertools.accumulate(spans, initial=0))
        device = _local(states[0]["exp_avg"]).device
        self.buckets: list[_Bucket] = []
        first = 0
        for i in range(1, len(sizes) + 1):
            if i == len(sizes) or starts[i + 1] - starts[first] > FLAT_BUCKET:
                members = range(first, i)
                self.buckets.append(_Bucket(members, sizes, spans, starts, offsets, device))
                first = i
        self.buffers: dict[str, torch.Tensor] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        for name in self.names:
            dtype = _local(states[0][name]).dtype
            buffer = torch.zeros(starts[-1], dtype=dtype, device=device)
            views = []
            for bucket in self.buckets:
                for part, i in zip(bucket.parts(bucket.of(buffer)), bucket.tensors, strict=True):
                    old = states[i][name]
                    local = _local(old)
                    part.copy_(local.reshape(-1))
                    states[i][name] = _like(old, part.view(local.shape))
                    views.append(states[i][name])
            self.buffers[name] = buffer
            self.views[name] = views
        self.names.append("step")
        self.views["step"] = [s["step"] for s in states]

    def of(self, bucket: _Bucket) -> dict[str, torch.Tensor | None]:
        """A bucket's range of each state's buffer, by state name (None for the states
        this optimizer does not keep)."""
        return {
            name: bucket.of(self.buffers[name]) if name in self.buffers else None
            for name in _STATE_NAMES
        }

    def update(
        self,
        update: Callable[..., None],
        bucket: _Bucket,
        flat_param: torch.Tensor,
        flat_grad: torch.Tensor,
        table: torch.Tensor,
        stochastic_rounding: bool,
        skip: torch.Tensor | None,
    ) -> None:
        """``update`` (the compiled ``adamw_update_flat``) of a bucket's gathered parameters
        and gradients with its range of the states."""
        state = self.of(bucket)
        update(
            flat_param,
            flat_grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["master"],
            table,
            bucket.blocks,
            bucket.shifts,
            stochastic_rounding,
            state["compensation"],
            skip,
        )

    def owns(self, state: Any) -> bool:
        """Whether every state entry is still this plan's view."""
        entries = list(map(state.get, self.owners))
        if None in entries:
            return False
        return all(
            all(map(operator.is_, map(dict.get, entries, itertools.repeat(name)), self.views[name]))
            for name in self.names
        )

    def part(self, name: str, i: int) -> torch.Tensor | None:
        """Tensor ``i``'s flat part of state ``name``, or None if there is no such state."""
        buffer = self.buffers.get(name)
        if buffer is None:
            return None
        bucket = next(b for b in self.buckets if i in b.tensors)
        return bucket.parts(bucket.of(buffer))[i - bucket.tensors.start]

    def release(self, state: Any) -> None:
        """Give every parameter that still holds a view a copy of its own."""
        for name in self.names:
            for p, view in zip(self.owners, self.views[name], strict=True):
                if state[p].get(name) is view:
                    state[p][name] = view.clone()
        self.buffers.clear()
        self.views.clear()


class _Steady:
    """The compiled path's work of a step that the next step can reuse: which parameters
    have gradients, their groups, flat states and shard layouts, and per bucket of each
    ``_FlatBatch`` the views a step gathers into and writes back from.

    ``step()`` makes a step with it while every parameter that had a gradient has one
    again (and no other), of the same dtype, the states are still the flat plans' views
    with equal step counts, and the parameters still hold the same memory in the same
    layout.
    Anything else (``load_state_dict``, a new param group, a parameter without a gradient,
    ``p.data`` replaced) sends the step down the full path, which builds a new one.

    Note: the full path's host work per parameter (checks, views, keys, a step count each)
    is most of a compiled step's time on an accelerator; here a step makes one addition
    for all step counts, one vectorised computation of the rounding keys, and three
    ``torch._foreach_copy_`` per bucket into and out of buffers kept from step to step (at
    most ``FLAT_BUCKET`` elements of parameters and of gradients per batch, the size of
    the largest bucket).
    """

    def __init__(self, opt: AdamW, batches: list[_FlatBatch]) -> None:
        self.sizes = [len(group["params"]) for group in opt.param_groups]
        self.params = [p for group in opt.param_groups for p in group["params"]]
        self.has_grad = [p.grad is not None for p in self.params]
        self.impl = opt.impl
        self.state = opt.state
        groups = {id(p): group for group in opt.param_groups for p in group["params"]}
        self.batches = [
            _SteadyBatch(b, opt._flat_plan(b), groups[id(b.owners[0])]) for b in batches
        ]

    def step(self, opt: AdamW, skip: torch.Tensor | None, clip_coef: torch.Tensor | None) -> bool:
        """One step, if nothing it reuses has changed; False (having changed nothing) if
        something has."""
        if opt.impl != self.impl or opt.state is not self.state:
            return False
        if [len(group["params"]) for group in opt.param_groups] != self.sizes:
            return False
        params = [p for group in opt.param_groups for p in group["params"]]
        if not all(map(operator.is_, params, self.params)):
            return False
        if [g is not None for g in map(_GRAD, params)] != self.has_grad:
            return False
        grads = []
        for b in self.batches:
            found = b.gradients(opt.state, skip, clip_coef)
            if found is None:
                return False
            grads.append(found)
        local = [b.local_grads(g) for b, g in zip(self.batches, grads, strict=True)]
        if clip_coef is not None:
            # as on the full path: each gradient in its parameter's layout, multiplied in place
            scale_in_place([g for batch in local for g in batch], clip_coef)
        for b, g in zip(self.batches, local, strict=True):
            b.run(opt, g, skip)
        return True


_GRAD = operator.attrgetter("grad")


def _check_scalar(
    name: str, value: Any, kind: str, of_kind: Callable[[torch.Tensor], bool]
) -> None:
    """Refuse a ``step`` argument that is neither None nor a 0-d tensor of its kind."""
    if value is None or (torch.is_tensor(value) and of_kind(value) and value.dim() == 0):
        return
    got = (
        f"a {value.dtype} tensor of shape {tuple(value.shape)}"
        if torch.is_tensor(value)
        else type(value).__name__
    )
    raise TypeError(f"hlat_optim.AdamW.step: {name} must be a 0-d {kind} tensor, got {got}")


_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")


class _SteadyBatch:
    """One ``_FlatBatch`` of a ``_Steady`` step: its parameters, flat states and buckets,
    with buffers for the gathered parameters and gradients and their parts' views."""

    def __init__(self, batch: _FlatBatch, plan: _FlatStates, group: dict[str, Any]) -> None:
        self.plan = plan
        self.group = group
        self.device = batch.device
        self.step = batch.step
        self.owners = batch.owners
        self.locals = batch.locals
        self.pointers = [t.data_ptr() for t in batch.locals]
        self.strides = [t.stride() for t in batch.locals]
        self.indices = [index for index, _ in batch.keys]
        self.is_dtensor = [_is_dtensor(p) for p in batch.owners]
        self.dtensor = any(self.is_dtensor)
        self.grad_dtype = batch.grads[0].dtype
        # (parameter index, key salt) of each tensor, and one more pair: a bucket's table
        # takes the keys of its tensors and the next one, its unread last key (see _Bucket)
        words = torch.tensor([*batch.keys, (0, 0)], dtype=torch.int64).T.contiguous()
        self.words = (words[0], words[1])
        size = max(b.end - b.begin for b in plan.buckets)
        # Note: zeros, so that the gaps between tensors stay zeros in every buffer.
        self.param_buffer = torch.zeros(size, dtype=batch.locals[0].dtype, device=self.device)
        self.grad_buffer = torch.zeros(size, dtype=self.grad_dtype, device=self.device)
        self.param_parts = [self._parts(self.param_buffer, b) for b in plan.buckets]
        self.grad_parts = [self._parts(self.grad_buffer, b) for b in plan.buckets]

    def _parts(self, buffer: torch.Tensor, bucket: _Bucket) -> list[torch.Tensor]:
        parts = bucket.parts(buffer.narrow(0, 0, bucket.end - bucket.begin))
        return [
            part.view(self.locals[i].shape) for part, i in zip(parts, bucket.tensors, strict=True)
        ]

    def gradients(self, state: Any, *flags: torch.Tensor | None) -> list[Any] | None:
        """The parameters' gradients if this batch can step as it did (the same gradients'
        kind, states and parameters' memory, and equal step counts), else None. ``flags``:
        ``step``'s ``skip`` and ``clip_coef``."""
        if self.device.type == "cpu" and any(
            f is not None and f.device.type != "cpu" for f in flags
        ):
            return None  # the full path reports it
        # Note: _Steady.step has checked that each of these parameters has a gradient. The
        # checks map C functions over the tensors: their cost per tensor is most of a
        # step's host work.
        grads: list[Any] = list(map(_GRAD, self.owners))
        if not (
            all(map(operator.is_, map(_DTYPE, grads), itertools.repeat(self.grad_dtype)))
            and all(map(operator.is_, map(_LAYOUT, grads), itertools.repeat(torch.strided)))
        ):
            return None
        if self.dtensor:
            if list(map(_is_dtensor, grads)) != self.is_dtensor:
                return None
            owners = [_local(p) for p in self.owners]
        else:
            owners = self.owners
        # Note: a gradient in any layout is copied in through a view of its shape; the
        # parameters must hold the memory, in the layout, that the full step checked.
        if (
            list(map(torch.Tensor.data_ptr, owners)) != self.pointers
            or list(map(torch.Tensor.stride, owners)) != self.strides
            or not self.plan.owns(state)
        ):
            return None
        counts = self.plan.steps.tolist()
        return grads if counts.count(self.step) == len(counts) else None

    def local_grads(self, grads: list[Any]) -> list[torch.Tensor]:
        """The local tensors of ``grads`` (the parameters' gradients), each brought to its
        parameter's layout first (as ``AdamW._locals`` does)."""
        if not self.dtensor:
            return grads
        local_grads = []
        for p, grad, dtensor in zip(self.owners, grads, self.is_dtensor, strict=True):
            pd: Any = p
            if dtensor and tuple(grad.placements) != tuple(pd.placements):
                grad = grad.redistribute(pd.device_mesh, pd.placements)
            local_grads.append(_local(grad))
        return local_grads

    def run(self, opt: AdamW, grads: list[torch.Tensor], skip: torch.Tensor | None) -> None:
        self.plan.steps.add_(1.0)
        self.step += 1
        hyper = _hyper(self.group, self.step)
        seed = self.group["seed"]
        if skip is not None and skip.device != self.device:
            skip = skip.to(self.device, non_blocking=True)
        update = _compiled_update(
            opt.compile_backend or _default_backend(self.device), self.device.type
        )
        keys = _step_keys(seed, self.step, *self.words)
        for k, bucket in enumerate(self.plan.buckets):
            tensors = bucket.tensors
            params = self.locals[tensors.start : tensors.stop]
            torch._foreach_copy_(self.param_parts[k], params)
            torch._foreach_copy_(self.grad_parts[k], grads[tensors.start : tensors.stop])
            size = bucket.end - bucket.begin
            table = _flat_table(hyper, keys[tensors.start : tensors.stop + 1], self.device)
            self.plan.update(
                update,
                bucket,
                self.param_buffer.narrow(0, 0, size),
                self.grad_buffer.narrow(0, 0, size),
                table,
                opt.stochastic_rounding,
                skip,
            )
            torch._foreach_copy_(params, self.param_parts[k])


def _like(old: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in ``old``'s place: a DTensor with ``old``'s layout over it if ``old`` is
    one, else ``local`` itself."""
    if not _is_dtensor(old):
        return local
    from torch.distributed.tensor import DTensor

    d: Any = old
    return DTensor.from_local(
        local, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
    )


class _NativeBatch:
    """The updates of one step that go to the CPU kernel, made in one call at the end."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = []
        self.hypers: list[list[float]] = []
        self.indices: list[int] = []
        self.keep: list[list[torch.Tensor | None]] = []  # alive until the call
        # (parameter, its contiguous copy that the kernel updates) of non-contiguous ones
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(
        self,
        local: list[torch.Tensor | None],
        hyper: list[float],
        key: int,
        offset: int,
        stochastic_rounding: bool,
        index: int,
    ) -> None:
        param, grad, exp_avg, exp_avg_sq, master, compensation = local
        assert param is not None and grad is not None
        assert exp_avg is not None and exp_avg_sq is not None
        # Note: the kernel reads every tensor as a flat buffer in row-major order; a
        # parameter or gradient in another layout is read from a contiguous copy, and the
        # parameter's copy is written back after the call (``run``).
        if not grad.is_contiguous():
            grad = grad.contiguous()
        if not param.is_contiguous():
            work = param.contiguous()
            self.copies.append((param, work))
            param = work
        local = [param, grad, exp_avg, exp_avg_sq, master, compensation]
        bf16 = torch.bfloat16
        flags = (
            (param.dtype == bf16)
            | (grad.dtype == bf16) << 1
            | (exp_avg.dtype == bf16) << 2
            | bool(stochastic_rounding) << 3
        )
        self.rows.append(
            [
                param.data_ptr(),
                grad.data_ptr(),
                exp_avg.data_ptr(),
                exp_avg_sq.data_ptr(),
                master.data_ptr() if master is not None else 0,
                compensation.data_ptr() if compensation is not None else 0,
                param.numel(),
                flags,
                key & 0xFFFFFFFF,
                offset & 0xFFFFFFFF,
            ]
        )
        self.hypers.append(hyper)
        self.indices.append(index)
        self.keep.append(local)

    def run(self, skip: torch.Tensor | None, clip_coef: torch.Tensor | None = None) -> None:
        """One kernel call; ``skip`` (a CPU bool tensor or None) and ``clip_coef`` (a CPU
        float32 tensor or None) are read by the kernel."""
        if not self.rows:
            return
        lib = _native.load()
        assert lib is not None
        table = torch.tensor(self.rows, dtype=torch.int64)
        hypers = torch.tensor(self.hypers, dtype=torch.float32)
        rc = lib.hlat_adamw_step(
            len(self.rows),
            table.data_ptr(),
            hypers.data_ptr(),
            torch.get_num_threads(),
            skip.data_ptr() if skip is not None else None,
            clip_coef.data_ptr() if clip_coef is not None else None,
        )
        if rc != 0:
            raise RuntimeError(
                f"hlat_optim.AdamW: the CPU kernel rejected parameter {self.indices[rc - 1]}'s "
                "combination of dtypes and states"
            )
        if self.copies:
            torch._foreach_copy_([p for p, _ in self.copies], [w for _, w in self.copies])
